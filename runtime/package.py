"""Read a generated package DIR: its manifest and its stage modules; the names stage code imports.

Everything here reads only `manifest.json` (as `runtime.manifest.Manifest`), the stage
files and the package's copy of the model file (runtime.model_file): a rank needs torch alone.
The rest of reading a package has a module each, whose names this one re-exports:
weights.py (a stage's tensors against the original state_dict; [Note: shards] is written
there), edges.py (the values between stages) and microbatches.py (a batch cut into
microbatches).  Generated stage files import `kept_module`, `model_file_of` and
`register_output` (runtime/outputs.py) from here.
"""

from __future__ import annotations

import copy
import types
from pathlib import Path

import torch

from .edges import dtype_of, edge_grads, edge_values, value_shape
from .errors import ManifestError
from .manifest import FORMAT_VERSION, Manifest, read_manifest
from .microbatches import loss_scales, microbatch_rows, replica_rows, split_inputs, split_target
from .model_file import import_file as _import_file
from .model_file import load_loss_fn, load_model_file, share_running_script
from .outputs import register_output
from .weights import (Held, KeyMismatch, assemble_state_dict, check_state_dict, few, key_mismatch,
                      load_stage_state, stage_tensors)

__all__ = [
    "FORMAT_VERSION",
    "load_manifest",
    "import_stage",
    "load_model_file",
    "load_loss_fn",
    "model_file_of",
    "kept_module",
    "register_output",
    "stage_tensors",
    "check_state_dict",
    "KeyMismatch",
    "key_mismatch",
    "few",
    "load_stage_state",
    "assemble_state_dict",
    "split_inputs",
    "split_target",
    "microbatch_rows",
    "replica_rows",
    "loss_scales",
    "value_shape",
    "edge_values",
    "edge_grads",
    "dtype_of",
    "Held",
]

_model_files: dict[Path, types.ModuleType] = {}
_models: dict[Path, torch.nn.Module] = {}


# -- manifest ------------------------------------------------------------------------------


#: a package folder's manifest: the one reader, `manifest.read_manifest`
load_manifest = read_manifest


# -- modules -------------------------------------------------------------------------------


def import_stage(directory: str | Path, manifest: Manifest, index: int) -> torch.nn.Module:
    """A fresh instance of stage `index`, imported from its own file only."""
    entry = manifest.stages[index]
    path = Path(directory).resolve() / f"{entry.module}.py"
    if not path.is_file():
        raise ManifestError(f"stage {index}'s file {path} is missing: compile the model again.")
    share_running_script(manifest, path.parent)  # before the stage imports the script's copy
    module = _import_file(path, f"_pipeline_{(manifest.hash or 'pkg')[:12]}_{entry.module}")
    cls = getattr(module, entry.class_name, None)
    if cls is None:
        raise ManifestError(f"{path} defines no class {entry.class_name!r}, which the manifest names: compile the model again.")
    stage = cls()
    if not isinstance(stage, torch.nn.Module):
        raise ManifestError(f"{path}: {entry.class_name} is not a torch.nn.Module.")
    return stage  # type: ignore[no-any-return]


def model_file_of(stage_file: str) -> types.ModuleType:
    """The model file the package holding `stage_file` was compiled from, imported once per
    package: a stage that calls the user's own code (a custom autograd Function, a module
    kept whole) reads it from there, so every stage shares the same classes."""
    directory = Path(stage_file).resolve().parent
    if directory not in _model_files:
        _model_files[directory] = load_model_file(load_manifest(directory), directory)
    return _model_files[directory]


def kept_module(stage_file: str, path: str) -> torch.nn.Module:
    """A fresh copy of the user's submodule `path` (a module the compiler kept whole): the
    model built once per package by the model file's entry (`manifest.source`), with the
    caller's RNG left as it was; its weights are the stage's, passed at each call."""
    directory = Path(stage_file).resolve().parent
    if directory not in _models:
        source = load_manifest(directory).source
        build = getattr(model_file_of(stage_file), source.entry)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(source.seed)
            _models[directory] = build()
    return copy.deepcopy(_models[directory].get_submodule(path))
