"""The runtime's error hierarchy, rooted at one `PipelineError`.

Every error a user can fix is a `PipelineError`: the command line turns it into exit
status 2 and one paragraph (it matches the class by name, so the runtime never imports
the compiler's own hierarchy).  A message names the thing that is wrong and the fix.
"""

from __future__ import annotations

__all__ = [
    "PipelineError",
    "ManifestError",
    "ScheduleError",
    "StateDictError",
    "BatchError",
    "MeshError",
    "PeerError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointCorruptError",
    "NonFiniteError",
    "CheckpointSpaceError",
    "EngineError",
]


class PipelineError(Exception):
    """A problem a user can fix: a package, a batch, a launch, a failed peer."""


class ManifestError(PipelineError):
    """A package directory, its manifest.json or a stage file is missing or corrupt."""


class ScheduleError(PipelineError):
    """A schedule is malformed, misses or repeats an action, or deadlocks."""


class StateDictError(PipelineError):
    """A state_dict does not match the package: missing or unexpected keys, bad shapes."""


class BatchError(PipelineError):
    """A batch does not split into the package's microbatches, or has the wrong shape."""


class MeshError(PipelineError):
    """The process group does not match the package's mesh, or ranks run different packages."""


class PeerError(PipelineError):
    """Another rank stopped, failed or timed out while this rank waited on it."""


class CheckpointError(PipelineError):
    """A checkpoint is incomplete, corrupt, or does not match the model (runtime/checkpoint/)."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint folder, or the folder checkpoints are looked for in, does not exist."""


class CheckpointCorruptError(CheckpointError):
    """A file of a checkpoint is not the one saved ([Note: checkpoint checksums]); `file` names it."""

    def __init__(self, message: str, file: object = None) -> None:
        super().__init__(message)
        self.file = file


class CheckpointSpaceError(CheckpointError):
    """A save found its disk full ([Note: a full disk at a save] in checkpoint/space.py); nothing was kept of it."""


class NonFiniteError(PipelineError):
    """A step's loss or gradients are not finite under `--on-nonfinite stop` ([Note: non-finite steps])."""


class EngineError(PipelineError):
    """The engine asked for cannot run this package (a schedule it lacks, an edge it cannot carry)."""
