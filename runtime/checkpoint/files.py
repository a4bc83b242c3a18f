"""load_checkpoint of a .safetensors file or a Hugging Face model folder (model.safetensors, or
model.safetensors.index.json and its shards), lazily: each process reads only the tensors it
holds and, of a tensor-parallel shard, only its boxes ([Note: checkpoint chunks]) through
safetensors' `get_slice`.  Names are the original model's; the manifest's aliases (tied
weights: Hugging Face saves `lm_head.weight` or not) are honoured."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..errors import CheckpointError
from ..weights import _expected_keys, key_mismatch
from .chunks import boxes, global_shape
from .view import View

__all__ = ["is_weights_file", "load_weights"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def is_weights_file(path: Path) -> bool:
    """A .safetensors file, or a folder holding model.safetensors or its sharded index."""
    return (path.is_file() and path.suffix == ".safetensors") or (path / INDEX).is_file() or (path / SINGLE).is_file()


def _where(path: Path) -> dict[str, Path]:
    """tensor name -> the file holding it."""
    if (path / INDEX).is_file():
        try:
            weight_map = json.loads((path / INDEX).read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{path / INDEX} is not a safetensors index (no weight_map: {exc}): save the "
                                  f"model again with save_pretrained.") from None
        return {name: path / file for name, file in weight_map.items()}
    file = path if path.is_file() else path / SINGLE
    with safe_open(str(file), "pt", device="cpu") as f:
        return {name: file for name in f.keys()}


def load_weights(view: View, path: str | Path, strict: bool = True) -> int:
    """Copy each held tensor's boxes from the files; returns the bytes read."""
    root = Path(path)
    where = _where(root)
    keys = _expected_keys(view.manifest)
    wrong = key_mismatch(where.keys(), view.manifest, strict)
    if wrong:
        raise CheckpointError(f"{root} does not hold the package's model ({wrong.describe()}): give the weights of "
                              f"the model the package was compiled from"
                              f"{'' if wrong.unexpected else ', or pass strict=False to leave the missing ones as they are'}.")
    read = 0
    handles: dict[Path, Any] = {}
    done: set[int] = set()
    try:
        for spec, tensor in view.held:
            if id(tensor) in done:  # a tied parameter that two stages of this process share
                continue
            done.add(id(tensor))
            name = next((n for n in keys[spec.source_name] if n in where), None)
            if name is None:
                continue
            file = where[name]
            if file not in handles:
                handles[file] = safe_open(str(file), "pt", device="cpu").__enter__()
            read += _copy(handles[file].get_slice(name), name, file, spec, tensor)
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)
    return read


def _copy(piece: Any, name: str, file: Path, spec: Any, tensor: torch.Tensor) -> int:
    """Read this tensor's boxes of `name` into it; the bytes read."""
    full = list(global_shape(spec, tensor.shape))
    if list(piece.get_shape()) != full:
        raise CheckpointError(f"{file}: {name} has shape {list(piece.get_shape())} but the package's model has "
                              f"{full}: give the weights of the model the package was compiled from.")
    read = 0
    with torch.no_grad():
        for offsets, local in boxes(spec, tensor.detach()):
            index = tuple(slice(o, o + s) for o, s in zip(offsets, local.shape))
            value = piece[index] if index else piece[:]
            local.copy_(value.reshape(local.shape))
            read += value.numel() * value.element_size()
    return read
