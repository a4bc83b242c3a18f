"""Each CPU rank on cores of its own.

[Note: binding CPU ranks to cores]
    Every pipeline hand-over wakes threads (the receiver's main thread, gloo's I/O
    threads); left to the scheduler they land on the other rank's core or move and run
    with cold caches, so each CPU rank's threads get cores of their own (measured:
    docs/notes/cpu-binding.md).  On CPU, when the cores the process may use divide
    among the local ranks (at least one each), `bind_local_rank` gives local rank r the
    r-th contiguous share and binds every thread the process has now (gloo's included);
    threads started later inherit it.
    The local rank and count are torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE (the global
    rank and world size without them).  Since the cores shared out are those the process
    may use, `taskset -c 0-3 torchrun ...` shares cores 0-3; a rank left with less than a
    core is not bound, nor is a rank alone.  `PIPELINE_CPU_BIND=0` turns binding off.
    With GPUs, torchrun's `--numa-binding` is the tool.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

__all__ = ["bind_local_rank", "bind_threads", "binding_enabled", "bound_as_local_rank", "cpu_share"]


def binding_enabled() -> bool:
    """False when `PIPELINE_CPU_BIND` turns binding off (0, off, false, no)."""
    return os.environ.get("PIPELINE_CPU_BIND", "1").strip().lower() not in ("0", "off", "false", "no")


def cpu_share(allowed: set[int], local_rank: int, local_world: int) -> set[int] | None:
    """The cores local rank `local_rank` of `local_world` gets out of `allowed`: the
    r-th of `local_world` equal contiguous shares (the remainder unused), or None when
    there are fewer cores than ranks."""
    cores = sorted(allowed)
    per = len(cores) // local_world if local_world > 0 else 0
    if per < 1 or not 0 <= local_rank < local_world:
        return None
    return set(cores[local_rank * per:(local_rank + 1) * per])


def bind_local_rank(local_rank: int, local_world: int) -> set[int] | None:
    """Bind every thread of this process to its share of the cores (`cpu_share`); the
    cores bound to, or None when nothing was done (see the note above)."""
    if not binding_enabled() or not hasattr(os, "sched_setaffinity") or local_world < 2:
        return None
    allowed = os.sched_getaffinity(0)
    share = cpu_share(allowed, local_rank, local_world)
    if share is None or share == allowed:
        return None
    bind_threads(share)
    return share


@contextlib.contextmanager
def bound_as_local_rank(local_rank: int, local_world: int) -> Iterator[set[int] | None]:
    """`bind_local_rank` for the duration (the cpu profile's message measurements run as
    the ranks will); every thread is given back the cores the process had before."""
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    share = bind_local_rank(local_rank, local_world)
    try:
        yield share
    finally:
        if share is not None and before is not None:
            bind_threads(before)


def bind_threads(cpus: set[int]) -> None:
    """Bind every thread this process has now to `cpus`."""
    for tid in _threads():
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # the thread has exited meanwhile
            pass


def _threads() -> list[int]:
    """This process's thread ids (the main thread alone where /proc is missing)."""
    try:
        return [int(t) for t in os.listdir(Path("/proc/self/task"))]
    except OSError:
        return [0]
