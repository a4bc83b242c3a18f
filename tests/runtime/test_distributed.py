"""DistributedPipeline in real processes (gloo on 127.0.0.1), each with a hard timeout.

Every rank runs dist_worker.py, which compares its loss, its gradients, the forward
output and the weights after 3 SGD steps with the reference model in that process.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from .conftest import Tiny

WORKER = Path(__file__).with_name("dist_worker.py")
pytestmark = pytest.mark.multiproc


@dataclass
class Rank:
    rc: int | None  # None: killed at the deadline
    out: str
    err: str
    seconds: float


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(n: int, mode: str, pkgs: list[Path], model: Path, deadline_s: float = 60.0,
           env: dict[str, str] | None = None) -> list[Rank]:
    """Start n ranks of dist_worker.py (rank r on pkgs[r % len(pkgs)]); kill whatever is
    left at the deadline so nothing can hang the test run."""
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(n),
            "OMP_NUM_THREADS": "1", "PIPELINE_TIMEOUT_S": "20", **(env or {})}
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, str(WORKER), mode, str(pkgs[r % len(pkgs)]), str(model)],
                              env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(n)]
    ranks = []
    for p in procs:
        left = max(0.1, deadline_s - (time.monotonic() - start))
        try:
            out, err = p.communicate(timeout=left)
            rc: int | None = p.returncode
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            rc = None
        ranks.append(Rank(rc, out, err, time.monotonic() - start))
    return ranks


def _ok(ranks: list[Rank]) -> None:
    for r, rank in enumerate(ranks):
        assert rank.rc == 0 and f"{r} ok" in rank.out, f"rank {r} exited {rank.rc}:\n{rank.err[-3000:]}"


@pytest.mark.timeout(120)
def test_two_stages(make_tiny: Callable[..., Tiny]) -> None:
    t = make_tiny(stages=2, schedule="1f1b", microbatches=4)
    _ok(launch(2, "check", [t.dir], t.dir.parent / "tiny.py"))


@pytest.mark.timeout(120)
def test_two_stages_two_replicas(make_tiny: Callable[..., Tiny]) -> None:
    t = make_tiny(stages=2, schedule="gpipe", microbatches=2, dp=2)
    _ok(launch(4, "check", [t.dir], t.dir.parent / "tiny.py"))


@pytest.mark.timeout(120)
def test_interleaved_two_virtual_stages_per_rank(make_tiny: Callable[..., Tiny]) -> None:
    # stages 0, 2 on rank 0 and 1, 3 on rank 1: a skip value stays in memory (0 -> 2),
    # another crosses (0 -> 3), and the tied weight lives on both ranks (0 and 3)
    t = make_tiny(stages=4, schedule="interleaved", microbatches=4, virtual_stages=2)
    _ok(launch(2, "check", [t.dir], t.dir.parent / "tiny.py"))


@pytest.mark.timeout(120)
def test_a_killed_rank_is_named_by_the_others(make_tiny: Callable[..., Tiny]) -> None:
    t = make_tiny(stages=2, schedule="1f1b", microbatches=4)
    ranks = launch(2, "fault", [t.dir], t.dir.parent / "tiny.py", env={"PIPELINE_FAULT": "1:1B1"})
    assert ranks[1].rc == 13, ranks[1].err[-2000:]
    assert ranks[0].rc == 3, f"rank 0 exited {ranks[0].rc}:\n{ranks[0].err[-2000:]}"
    assert ranks[0].seconds < 50
    assert "rank 0 (stage 0) failed in RECV_B from stage 1, microbatch 1: rank 1 stopped or failed" in ranks[0].err


@pytest.mark.timeout(120)
def test_mismatched_packages_fail_at_start(make_tiny: Callable[..., Tiny]) -> None:
    a, b = make_tiny(stages=2, microbatches=4), make_tiny(stages=2, microbatches=2)
    ranks = launch(2, "fault", [a.dir, b.dir], a.dir.parent / "tiny.py")
    for rank in ranks:
        assert rank.rc == 3 and "the ranks run different packages" in rank.err, rank.err[-2000:]
    one = launch(1, "fault", [a.dir], a.dir.parent / "tiny.py")[0]
    assert one.rc == 3 and "planned for pp=2 x tp=1 x dp=1 = 2 ranks but WORLD_SIZE is 1" in one.err, one.err[-2000:]
