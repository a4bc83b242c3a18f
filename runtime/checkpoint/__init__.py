"""Checkpoints: save and resume on any plan (dcp.py), atomically (commit.py); weights from
safetensors files and Hugging Face folders (files.py).

See docs/checkpoints.md, and [Note: checkpoint chunks] / [Note: checkpoint commit].
torch.distributed.checkpoint (about 2 s to import) is imported on the first save or load.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from .commit import latest_checkpoint
from .view import View

__all__ = ["View", "save", "load", "latest_checkpoint"]


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
