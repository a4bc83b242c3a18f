"""Import a package's model file: the copy kept beside the stages ([Note: the model file's
copy] in runtime/manifest.py), or, for a package compiled before copies, the file its
manifest names."""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import sys
import types
from pathlib import Path
from typing import Any, Callable

import torch

from .errors import ManifestError
from .manifest import Manifest

__all__ = ["MODULE_PREFIX", "import_file", "model_file_path", "load_model_file", "load_loss_fn", "share_running_script"]

_counter = itertools.count()
#: the name a package's model file is imported under, before its number (`import_file`)
MODULE_PREFIX = "_pipeline_model"
#: (model file, its sha256) -> the module imported from it (`load_model_file`)
_imported: dict[tuple[Path, str], types.ModuleType] = {}


def import_file(path: Path, prefix: str) -> types.ModuleType:
    """Import the Python file at `path` under a fresh, unique module name, with the file's
    own folder on sys.path while it runs (the modules beside it import)."""
    name = f"{prefix}_{next(_counter)}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ManifestError(f"{path} cannot be imported as a Python file.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        sys.path.remove(str(path.parent))
    return module


def model_file_path(manifest: Manifest, directory: str | Path) -> Path | None:
    """The model file package `directory` reads (its copy; for an older package the path its
    manifest names: absolute, else relative to the working directory, else to the package's
    parent), or None when none of these is a file."""
    source, folder = manifest.source, Path(directory).resolve()
    if source.copy:
        copy = folder / Path(source.copy).name  # a bare file name: never outside the package
        return copy if copy.is_file() else None
    given = Path(source.path)
    candidates = [given] if given.is_absolute() else [Path.cwd() / given, folder.parent / given]
    return next((p.resolve() for p in candidates if p.is_file()), None)


def load_model_file(manifest: Manifest, directory: str | Path) -> types.ModuleType:
    """The model file of package `directory` ([Note: the model file's copy]), imported once
    per process and file contents: the stages, `loss_fn` and the training script all see
    one module, so a class it defines is one class ([Note: output classes] in
    partitioner/trace/outputs.py: an output the last stage makes is an instance of the
    class `loss_fn` knows)."""
    path = model_file_path(manifest, directory)
    if path is None:
        raise ManifestError(_missing(manifest, directory))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if manifest.source.copy:
        _check_copy(path, digest, manifest.source.sha256, manifest.source.path)
    key = (path.resolve(), digest)
    if key not in _imported:
        _imported[key] = _import(manifest, path)
    return _imported[key]


def _import(manifest: Manifest, path: Path) -> types.ModuleType:
    if not manifest.source.copy:
        return import_file(path, MODULE_PREFIX)
    share_running_script(manifest, path.parent)
    try:
        return import_file(path, MODULE_PREFIX)  # the modules copied beside it import
    except ModuleNotFoundError as exc:
        raise ManifestError(_sibling(exc, manifest.source.path, path)) from exc


def share_running_script(manifest: Manifest, directory: str | Path) -> None:
    """A module the package copied beside its model file that is the script this process
    runs (`__main__`, byte for byte: a model `partitioner.parallelize` recorded from the
    script that calls it) is imported as that script's own module, so the package's classes
    are the script's: the pipeline returns the script's output class, not a copy's
    ([Note: output classes] in partitioner/trace/outputs.py)."""
    main = sys.modules.get("__main__")
    script = _file_of(main)
    if main is None or script is None:
        return
    for name in manifest.source.modules:
        held = sys.modules.get(Path(name).stem)
        if _file_of(Path(directory) / name) == script and (held is None or _another_copy(held, script)):
            sys.modules[Path(name).stem] = main


def _file_of(module: types.ModuleType | Path | None) -> bytes | None:
    """The bytes of a module's file (or of a path), None where there is none."""
    path = Path(getattr(module, "__file__", None) or "") if isinstance(module, types.ModuleType) else module
    return path.read_bytes() if path is not None and path.is_file() else None


def _another_copy(module: types.ModuleType, script: bytes) -> bool:
    """Whether `module` was imported from a copy of `script`: a file of the same bytes, or
    one since removed (parallelize's compile imports the copy it records in a folder it
    then deletes)."""
    path = getattr(module, "__file__", None)
    return path is not None and (not Path(path).exists() or _file_of(module) == script)


def _missing(manifest: Manifest, directory: str | Path) -> str:
    source = manifest.source
    if source.copy:
        return (f"package {directory} has lost its copy of the model file ({source.copy}, from {source.path}): "
                f"compile the model again, or pass loss_fn= to train_step.")
    given = Path(source.path)
    looked = given if given.is_absolute() else f"{Path.cwd() / given} and {Path(directory).resolve().parent / given}"
    return (f"the package's model file {source.path!r} is not found (looked at {looked}): this package predates "
            f"the copy packages keep of their model file, so run from the directory it was compiled in, compile "
            f"it again, or pass loss_fn= to train_step.")


def _check_copy(path: Path, digest: str, sha256: str, name: str) -> None:
    """The copy is the file that was compiled: its sha256 `digest` is the manifest's."""
    if sha256 and digest != sha256:
        raise ManifestError(f"{path} (the package's copy of {name}) has sha256 {digest[:16]} but the package was "
                            f"compiled from sha256 {sha256[:16]}: the copy was edited; compile the model again "
                            f"instead of editing the package.")


def _sibling(exc: ModuleNotFoundError, name: str, path: Path) -> str:
    """The error for a model file whose import of a module of its own folder fails."""
    missing = exc.name or str(exc)
    return (f"the model file {name} (the package's copy {path}) imports {missing!r}, which is not found: a package "
            f"keeps a copy of the model file and of the modules of its own folder it imports, no others. Put the folder that holds "
            f"{missing.split('.')[0]} on PYTHONPATH (or run from it), or install it, and load the package again.")


def load_loss_fn(manifest: Manifest, directory: str | Path) -> Callable[[Any, Any], torch.Tensor]:
    """The model file's `loss_fn(output, target)`."""
    fn = getattr(load_model_file(manifest, directory), "loss_fn", None)
    if not callable(fn):
        raise ManifestError(f"model file {manifest.source.path} defines no loss_fn(output, target): "
                            f"add one, or pass loss_fn= to train_step.")
    return fn  # type: ignore[no-any-return]
