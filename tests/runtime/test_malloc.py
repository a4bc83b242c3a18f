"""CPU ranks keep the memory they free (runtime/malloc.py)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest

glibc = pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "gnu_get_libc_version"),
                           reason="mallopt's parameters are glibc's")

# A step's pattern: blocks of 8, 4 and 12 MiB allocated, first-touched and freed; the
# page faults of 10 such steps after 3 warm-up ones, in a process of its own (mallopt is
# process-wide).
_STEPS = """
import resource, sys, torch
from runtime.malloc import GLIBC_DEFAULT_BYTES, keep_freed_memory, malloc_thresholds
if sys.argv[1] == "keep":
    assert keep_freed_memory()
else:  # glibc's initial thresholds, held there (left alone, they grow, or not, with the heap's layout)
    assert malloc_thresholds(GLIBC_DEFAULT_BYTES, GLIBC_DEFAULT_BYTES)
def step():
    a = torch.ones(2 << 20); b = torch.ones(1 << 20); del a; c = torch.ones(3 << 20); del b, c
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    root = str(Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-c", _STEPS, mode], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}, check=True)
    return int(out.stdout.strip())


@glibc
def test_freed_memory_is_reused_without_page_faults() -> None:
    """24 MiB first-touched per step is 6144 pages: at glibc's initial thresholds every
    step faults them in again (61,440 in 10 steps; left to grow, glibc's thresholds
    avoid that in some runs and not in others); with freed memory kept, the heap grows
    once in a while and is reused (0 to 2,048)."""
    default = _faults("default")
    assert default > 10 * 6144 // 2
    assert _faults("keep") < default / 10


def test_switched_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime.malloc import keep_freed_memory

    monkeypatch.setenv("PIPELINE_CPU_MALLOC", "0")
    assert keep_freed_memory() is False


def test_a_cpu_rank_keeps_freed_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """`init_from_env` (every DistributedPipeline) sets it on a CPU rank."""
    import torch.distributed as dist

    from runtime import comm

    called: list[bool] = []
    monkeypatch.setattr(comm, "keep_freed_memory", lambda: called.append(True) or True)
    monkeypatch.setattr(comm.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda: "gloo")
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    assert comm.init_from_env(5.0).type == "cpu"
    assert called == [True]
