"""CPU ranks keep the memory they free for their next step.

[Note: keeping freed memory]
    A step frees what it allocated (activations, and gradients at `zero_grad()`), and
    glibc gives large freed blocks back to the kernel, so the next step pays a page fault
    per fresh page (measured: docs/notes/keeping-freed-memory.md).  So a CPU rank sets
    glibc's M_MMAP_THRESHOLD to its largest value (32 MiB on 64-bit: smaller blocks
    come from the heap and are reused) and turns heap trimming off
    (M_TRIM_THRESHOLD -1), as a caching allocator (PyTorch's on CUDA) keeps what it frees:
    the process's resident memory stays at its peak step.  Blocks over 32 MiB are still
    mapped afresh.  `PIPELINE_CPU_MALLOC=0` turns this off; jemalloc or tcmalloc preloaded
    (`LD_PRELOAD`) do the same and more.  Nothing is done where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["keep_freed_memory", "malloc_thresholds", "MMAP_THRESHOLD_BYTES", "GLIBC_DEFAULT_BYTES"]

#: glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX = 4 MiB * sizeof(long))
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
#: glibc's initial mmap and trim thresholds (both then grow as large blocks are freed)
GLIBC_DEFAULT_BYTES = 128 * 1024
_M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's <malloc.h>
_M_MMAP_THRESHOLD = -3


def keep_freed_memory() -> bool:
    """Have glibc keep freed memory for reuse (see the note above); whether it was done.
    Not done with PIPELINE_CPU_MALLOC=0 (or off, false, no), or without glibc."""
    if os.environ.get("PIPELINE_CPU_MALLOC", "1").strip().lower() in ("0", "off", "false", "no"):
        return False
    return malloc_thresholds(MMAP_THRESHOLD_BYTES, -1)


def malloc_thresholds(mmap_bytes: int, trim_bytes: int) -> bool:
    """Set glibc's M_MMAP_THRESHOLD and M_TRIM_THRESHOLD (-1: never trim) for this
    process; False where the C library is not glibc or refuses the values."""
    try:
        libc = ctypes.CDLL(None)  # the C library this process already runs on (no ldconfig lookup)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # glibc only: another libc's mallopt takes other numbers
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_bytes)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_bytes))
