"""A save that finds its disk full: told clearly, and nothing of it kept.

[Note: a full disk at a save]
    When a rank's checkpoint writer raises OSError(ENOSPC), DCP's collective write hands
    the failure to every rank (CheckpointException, rank -> exception), so every rank
    raises CheckpointSpaceError at the same point of the save: the path that did not fit,
    the size of the newest complete checkpoint beside it (about what a save needs), the
    space free there, and the fix.  The coordinator removes the save's .partial folder, so
    the previous checkpoint stays the newest and no half-written bytes stay on the full
    disk.  Training's state (weights, optimizer, step) is in memory and untouched:
    `partitioner run` reports the failed save on rank 0 and trains on; the next save (the
    next --save-every step, or the last step's) tries again.  Restarting would not free
    the disk, so a full disk never counts as a fault to restart from.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import Any

from ..errors import CheckpointSpaceError
from .commit import complete

__all__ = ["disk_full", "space_error"]


def _failures(exc: BaseException) -> list[BaseException]:
    """`exc` and, for DCP's CheckpointException, every rank's exception inside it."""
    found: list[Any] = list(getattr(exc, "failures", {}).values())
    return [exc] + [f[0] if isinstance(f, tuple) else f for f in found]


def disk_full(exc: BaseException) -> OSError | None:
    """The OSError(ENOSPC) behind `exc`, if a full disk is what failed."""
    for failure in _failures(exc):
        while failure is not None:
            if isinstance(failure, OSError) and failure.errno == errno.ENOSPC:
                return failure
            failure = failure.__cause__ or failure.__context__  # type: ignore[assignment]
    return None


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def space_error(final: Path, tmp: Path, error: OSError, coordinator: bool) -> CheckpointSpaceError:
    """The error every rank raises ([Note: a full disk at a save]); the coordinator removes `tmp`."""
    if coordinator:
        shutil.rmtree(tmp, ignore_errors=True)
    previous = complete(final.parent) if final.parent.is_dir() else []
    need = (f"it needs about {_mib(_size(previous[0]))} (the size of {previous[0]})" if previous
            else "no earlier checkpoint tells how much it needs")
    free = _mib(shutil.disk_usage(final.parent).free) if final.parent.is_dir() else "unknown"
    kept = f"{previous[0]} stays the newest complete checkpoint" if previous else "no checkpoint was kept"
    return CheckpointSpaceError(
        f"no space left on the device saving checkpoint {final} (writing {error.filename or tmp}): {need}, and "
        f"{free} is free there. The save was abandoned and its partial folder removed; {kept}. Free space on "
        f"that disk, keep fewer checkpoints (--keep N, or save_checkpoint(..., keep=N)), or save elsewhere "
        f"(--checkpoint DIR on a larger disk).")
