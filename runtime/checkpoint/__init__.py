"""Checkpoints: save and resume on any plan (dcp.py), atomically (commit.py); weights from
safetensors files and Hugging Face folders (files.py).

See docs/checkpoints.md, and [Note: checkpoint chunks] / [Note: checkpoint commit].
torch.distributed.checkpoint (about 2 s to import) is imported on the first save or load.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointCorruptError
from .commit import complete, latest_checkpoint
from .view import View

__all__ = ["View", "save", "load", "latest_checkpoint", "load_latest"]


def save(view: View, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None,
         extra: Any = None, keep: int | None = None) -> Path:
    """dcp.save: write checkpoint PATH from every rank (collective)."""
    from . import dcp

    return dcp.save(view, path, optimizer, extra, keep)


def load(view: View, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None,
         strict: bool = True) -> Any:
    """Restore checkpoint PATH (dcp.load, collective), or read a .safetensors file or a Hugging
    Face folder (files.load_weights); the checkpoint's `extra` (None for weights files)."""
    from . import files

    if files.is_weights_file(Path(path)):
        if optimizer is not None:
            from ..errors import CheckpointError

            raise CheckpointError(f"{path} holds weights only, no optimizer state: call load_checkpoint({str(path)!r}) "
                                  f"without optimizer=, and build the optimizer fresh.")
        files.load_weights(view, Path(path), strict)
        return None
    from . import dcp

    return dcp.load(view, path, optimizer, strict)


def load_latest(pipe: Any, root: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None,
                strict: bool = True) -> tuple[Path, Any] | None:
    """`pipe.load_checkpoint` of the newest complete checkpoint under `root`, or, when a file
    of it is corrupt ([Note: checkpoint checksums]), of the newest one before it that is
    not (rank 0 says so in one line on stderr): (its path, its `extra`); None when `root`
    holds no complete checkpoint (or does not exist).  Raises CheckpointCorruptError when
    every one is corrupt, CheckpointNotFoundError when `root` is a file.  On every rank
    (collective)."""
    latest_checkpoint(root)  # the same refusal of a `root` that is a file
    found = complete(root)
    for path in found:
        try:
            return path, pipe.load_checkpoint(path, optimizer=optimizer, strict=strict)
        except CheckpointCorruptError as exc:
            last = exc
            if getattr(pipe, "rank", 0) == 0:
                print(f"checkpoint {path} is corrupt ({exc.file} changed after the save): loading the previous one",
                      file=sys.stderr, flush=True)
    if not found:
        return None
    raise CheckpointCorruptError(f"every complete checkpoint under {root} is corrupt ({len(found)}, the newest "
                                 f"{found[0]}): {last}") from None

