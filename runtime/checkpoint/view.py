"""What a pipeline shows the checkpoint code (imported by the pipelines, so it stays light:
torch.distributed.checkpoint is imported only when a checkpoint is saved or loaded)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..manifest import Manifest
from ..model_file import model_file_path
from ..weights import Held

__all__ = ["View"]


@dataclass
class View:
    """What a pipeline shows the checkpoint code: every stage tensor this process holds
    (entries with the shard index resolved, as package.stage_tensors gives them)."""

    manifest: Manifest
    held: list[tuple[Held, torch.Tensor]]
    rank: int
    world: int
    distributed: bool
    directory: Path | None = None  # the package's, to find the model file for the marker
    group: Any = None  # the pipeline's own process group of every rank (None: the default group)

    def model_file(self) -> str:
        """The absolute path of the model file the package reads (its copy, [Note: the model
        file's copy]), as model_file.load_model_file finds it ('' if absent)."""
        found = model_file_path(self.manifest, self.directory if self.directory is not None else Path.cwd())
        return "" if found is None else str(found)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    def specs(self) -> dict[int, Held]:
        return {id(t): spec for spec, t in self.held}
