"""`python -m partitioner export CKPT --out DIR [--hf]`: a checkpoint of save_checkpoint as the
original model's weights in safetensors (docs/checkpoints.md).

One process reads the whole model part of CKPT (what dcp_to_torch_save reads) and writes
DIR/model.safetensors, or, above `max_shard_bytes`, model-0000i-of-0000N.safetensors and the
model.safetensors.index.json that Hugging Face writes; with `hf`, the model file's model is
built on the meta device, takes the tensors (assign: no second copy) and `save_pretrained`
writes a folder that `from_pretrained` loads (config.json included).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .. import package
from ..errors import CheckpointError
from . import commit
from .dcp import _quiet

__all__ = ["export", "read_model_state", "write_safetensors"]

DEFAULT_SHARD_BYTES = 5 * 10**9


def read_model_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """The original model's state_dict in a checkpoint (complete ones only), on this process."""
    commit.verify(ckpt)
    reader = dcp.FileSystemReader(ckpt)
    state = {name: torch.empty(md.size, dtype=md.properties.dtype)
             for name, md in reader.read_metadata().state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}
    with _quiet():
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def write_safetensors(state: dict[str, torch.Tensor], out: Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[Path]:
    """model.safetensors, or shards of at most `max_shard_bytes` (a larger tensor alone) and
    their index; the files written."""
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = tensor.contiguous()
        size += nbytes
    out.mkdir(parents=True, exist_ok=True)
    if len(groups) == 1:
        save_file(groups[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return [out / "model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    for name, group in zip(names, groups):
        save_file(group, str(out / name), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": {k: n for n, g in zip(names, groups) for k in g}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return [out / n for n in names] + [out / "model.safetensors.index.json"]


def export(ckpt: str | Path, out: str | Path, hf: bool = False, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[Path]:
    """Write checkpoint `ckpt`'s weights into folder `out`; the files written."""
    ckpt, out = Path(ckpt), Path(out)
    info = commit.verify(ckpt)
    state = read_model_state(ckpt)
    if not hf:
        return write_safetensors(state, out, max_shard_bytes)
    model: Any = _build_meta(info, ckpt)
    if not callable(getattr(model, "save_pretrained", None)):
        raise CheckpointError(f"--hf: the model of {ckpt} ({type(model).__name__}) is not a Hugging Face model (it has "
                              f"no save_pretrained): export without --hf for a plain model.safetensors.")
    model.load_state_dict(state, assign=True)
    if callable(getattr(model, "tie_weights", None)):
        model.tie_weights()
    model.save_pretrained(out, max_shard_size=max_shard_bytes)
    return sorted(p for p in out.iterdir() if p.is_file())


def _build_meta(info: dict[str, Any], ckpt: Path) -> torch.nn.Module:
    path = Path(str(info.get("model_file", "")))
    if not path.is_file():
        raise CheckpointError(f"--hf needs the model file the checkpoint {ckpt} was saved from, and "
                              f"{path if str(path) not in ('', '.') else 'none'} is not there: put it back, or export "
                              f"without --hf.")
    module = package._import_file(path, "_export_model")
    with torch.device("meta"):
        return getattr(module, str(info.get("entry", "build_model")))()  # type: ignore[no-any-return]
