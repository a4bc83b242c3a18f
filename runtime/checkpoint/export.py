"""`python -m partitioner export CKPT --out DIR [--hf]`: a checkpoint of save_checkpoint as the
original model's weights in safetensors (docs/checkpoints.md).

One process reads the whole model part of CKPT (what dcp_to_torch_save reads) and writes
DIR/model.safetensors, or, above `max_shard_bytes`, model-0000i-of-0000N.safetensors and the
model.safetensors.index.json that Hugging Face writes; with `hf`, the model file's model is
built on the meta device, takes the tensors (assign: no second copy) and `save_pretrained`
writes a folder that `from_pretrained` loads (config.json included).

DIR is new, empty, or an earlier export (recognised by its stamp, EXPORT_STAMP, which lists
the files it wrote), replaced whole; a folder holding anything else is refused unless
`force`, and even then nothing export did not write is deleted or overwritten ([Note:
output folders] in runtime/outdir.py).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .. import outdir, package
from ..errors import CheckpointError
from . import commit
from .dcp import _quiet

__all__ = ["EXPORT_STAMP", "check_out", "earlier_export", "export", "read_model_state", "write_safetensors"]

DEFAULT_SHARD_BYTES = 5 * 10**9
#: the file an export writes last: the files it wrote, so a later export may replace them
EXPORT_STAMP = ".partitioner-export.json"
#: the names an export may write (the safetensors files, their index, a Hugging Face folder's json files)
_WRITES = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?|[a-z_]*config\.json|"
                     + re.escape(EXPORT_STAMP))


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


def export(ckpt: str | Path, out: str | Path, hf: bool = False, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
           force: bool = False) -> list[Path]:
    """Write checkpoint `ckpt`'s weights into folder `out`; the files written."""
    ckpt, out = Path(ckpt), Path(out)
    check_out(out, force)
    info = commit.verify(ckpt)
    state = read_model_state(ckpt)
    model: Any = _build_meta(info, ckpt) if hf else None
    if hf and not callable(getattr(model, "save_pretrained", None)):
        raise CheckpointError(f"--hf: the model of {ckpt} ({type(model).__name__}) is not a Hugging Face model (it has "
                              f"no save_pretrained): export without --hf for a plain model.safetensors.")
    written: list[str] = []

    def produce(folder: Path) -> None:
        if model is None:
            write_safetensors(state, folder, max_shard_bytes)
        else:
            model.load_state_dict(state, assign=True)
            if callable(getattr(model, "tie_weights", None)):
                model.tie_weights()
            model.save_pretrained(folder, max_shard_size=max_shard_bytes)
        written.extend(sorted(os.listdir(folder)))
        (folder / EXPORT_STAMP).write_text(json.dumps({"checkpoint": str(ckpt), "files": written}, indent=1) + "\n")

    try:
        outdir.write(out, produce, earlier_export, force=force, last=EXPORT_STAMP)
    except FileExistsError as exc:  # written there since the check
        raise CheckpointError(f"export --out {out}: {exc}: give another folder.") from None
    return [out / name for name in written]


def earlier_export(folder: Path) -> set[str] | None:
    """The files an earlier export wrote in `folder`, as its stamp lists them; None when
    there is no stamp (then nothing there is export's)."""
    try:
        files = json.loads((folder / EXPORT_STAMP).read_text())["files"]
        return {EXPORT_STAMP, *(str(name) for name in files)}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_out(out: Path, force: bool) -> None:
    """Refuse an --out folder holding what export did not write (without `force`), or,
    with it, a file of the name it writes ([Note: output folders])."""
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"export --out {out} is a file, not a folder: give a new folder.")
    stray = outdir.in_the_way(out, earlier_export, False)
    blocking = [n for n in stray if _WRITES.fullmatch(n)] if force else stray
    if blocking:
        raise CheckpointError(outdir.refusal(f"export --out {out}", blocking, force, output="export", writer="export",
                                             flag="--force"))


def _build_meta(info: dict[str, Any], ckpt: Path) -> torch.nn.Module:
    path = Path(str(info.get("model_file", "")))
    if not path.is_file():
        raise CheckpointError(f"--hf needs the model file the checkpoint {ckpt} was saved from, and "
                              f"{path if str(path) not in ('', '.') else 'none'} is not there: put it back, or export "
                              f"without --hf.")
    module = package._import_file(path, "_export_model")
    with torch.device("meta"):
        return getattr(module, str(info.get("entry", "build_model")))()  # type: ignore[no-any-return]
