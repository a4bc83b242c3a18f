"""The one error hierarchy of the compiler.

Every error a user can fix is a `PartitionerError`; the command line turns it into exit
status 2 and a single paragraph on stderr, never a traceback.  A message names the thing
that is wrong, what was expected, and the fix.
"""

from __future__ import annotations

__all__ = [
    "PartitionerError",
    "ModelFileError",
    "TraceError",
    "PlanError",
    "InfeasiblePlanError",
    "BeyondCapError",
    "PackageError",
    "ParallelizeError",
]


class PartitionerError(Exception):
    """A problem with the user's input; the CLI reports it and exits with status 2."""


class ModelFileError(PartitionerError):
    """The model file is missing, does not import, or breaks the model-file convention."""


class TraceError(PartitionerError):
    """No tracer could turn the model into a graph."""


class PlanError(PartitionerError):
    """The options ask for a plan that cannot exist (bad stage count, schedule...)."""


class InfeasiblePlanError(PlanError):
    """No assignment of the graph to stages fits the memory limit."""


class BeyondCapError(InfeasiblePlanError):
    """No plan fits with every rank's compute within a search's cap, `cap_s` (`solve(cap_s=...)`):
    none fits at all, or every one that does is slower than the best step found.  The
    search catches it; it never reaches the user."""

    def __init__(self, message: str, cap_s: float) -> None:
        super().__init__(message)
        self.cap_s = cap_s

    def __reduce__(self) -> tuple[type, tuple[str, float]]:  # pickled whole, as a worker's error
        return type(self), (str(self), self.cap_s)


class PackageError(PartitionerError):
    """A generated package is missing, corrupt, or does not match this run."""


class ParallelizeError(PartitionerError):
    """`partitioner.parallelize`: an option, a model or a loss_fn it cannot take, or ranks that
    could not agree on the package."""
