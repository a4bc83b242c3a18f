"""DistributedPipeline in real processes (gloo on 127.0.0.1), each with a hard timeout.

Every rank runs dist_worker.py, which compares its loss, its gradients, the forward
output and the weights after 3 SGD steps with the reference model in that process.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

import runtime
from runtime import package
from runtime.world import check_ranks as _check_ranks
from runtime.errors import ManifestError, MeshError
from runtime.groups import Mesh
from runtime.schedule import StageGraph

from .conftest import Tiny

WORKER = Path(__file__).with_name("dist_worker.py")
multiproc = pytest.mark.multiproc


@dataclass
class Rank:
    rc: int | None  # None: killed at the deadline
    out: str
    err: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(n: int, mode: str, pkgs: list[Path], model: Path, deadline_s: float = 60.0,
           env: dict[str, str] | None = None) -> list[Rank]:
    """Run n ranks of dist_worker.py (rank r on pkgs[r % len(pkgs)]); kill the whole
    process group at the deadline so nothing can hang the test run."""
    outdir = model.parent / f"ranks-{mode}-{n}-{time.monotonic_ns()}"
    outdir.mkdir()
    full = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(n),
            "OMP_NUM_THREADS": "1", "PIPELINE_TIMEOUT_S": "20", **(env or {})}
    proc = subprocess.Popen([sys.executable, str(WORKER), str(n), mode, str(outdir), str(model), *map(str, pkgs)],
                            env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        summary, _ = proc.communicate(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        summary, _ = proc.communicate()
    codes = dict(line.split(": ") for line in summary.splitlines() if line.startswith("rank "))
    ranks = []
    for r in range(n):
        code = codes.get(f"rank {r}")
        ranks.append(Rank(None if code is None else int(code), _read(outdir / f"rank{r}.out"),
                          _read(outdir / f"rank{r}.err") + ("" if code is not None else summary)))
    return ranks


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _ok(ranks: list[Rank]) -> None:
    for r, rank in enumerate(ranks):
        assert rank.rc == 0 and f"{r} ok" in rank.out, f"rank {r} exited {rank.rc}:\n{rank.err[-3000:]}"


@multiproc
@pytest.mark.timeout(120)
def test_two_stages(make_tiny: Callable[..., Tiny]) -> None:
    t = make_tiny(stages=2, schedule="1f1b", microbatches=4)
    ranks = launch(2, "check", [t.dir], t.dir.parent / "tiny.py")
    _ok(ranks)
    cores = sorted(os.sched_getaffinity(0))
    cpus = [re.search(rf"^{r} cpus (.*)$", rank.out, re.M) for r, rank in enumerate(ranks)]
    assert all(cpus), [rank.out for rank in ranks]
    if len(cores) >= 2:  # each rank on its own half of the cores (runtime/affinity.py)
        halves = [",".join(map(str, cores[r * (len(cores) // 2):(r + 1) * (len(cores) // 2)])) for r in range(2)]
        assert [m.group(1) for m in cpus if m] == halves


@multiproc
@pytest.mark.timeout(120)
def test_two_stages_two_replicas(make_tiny: Callable[..., Tiny]) -> None:
    t = make_tiny(stages=2, schedule="gpipe", microbatches=2, dp=2)
    _ok(launch(4, "check", [t.dir], t.dir.parent / "tiny.py"))


@multiproc
@pytest.mark.timeout(120)
def test_interleaved_two_virtual_stages_per_rank(make_tiny: Callable[..., Tiny]) -> None:
    # stages 0, 2 on rank 0 and 1, 3 on rank 1: a skip value stays in memory (0 -> 2),
    # another crosses (0 -> 3), and the tied weight lives on both ranks (0 and 3)
    t = make_tiny(stages=4, schedule="interleaved", microbatches=4, virtual_stages=2)
    _ok(launch(2, "check", [t.dir], t.dir.parent / "tiny.py"))


@multiproc
@pytest.mark.timeout(120)
def test_a_killed_rank_is_named_by_the_others(make_tiny: Callable[..., Tiny]) -> None:
    t = make_tiny(stages=2, schedule="1f1b", microbatches=4)
    ranks = launch(2, "fault", [t.dir], t.dir.parent / "tiny.py", env={"PIPELINE_FAULT": "1:1B1"})
    assert ranks[1].rc == 13, ranks[1].err[-2000:]
    assert ranks[0].rc == 3, f"rank 0 exited {ranks[0].rc}:\n{ranks[0].err[-2000:]}"
    # rank 0 is posting the send of microbatch 2 or waiting for the gradient of microbatch 1 (or 0:
    # rank 1 may exit before gloo has delivered its already posted SEND_B of microbatch 0)
    assert re.search(r"rank 0 \(stage 0\) failed in (SEND_F to|RECV_B from) stage 1, microbatch [012]: "
                     r"rank 1 stopped or failed \(.+\)\. Look at rank 1's own error", ranks[0].err), ranks[0].err


@multiproc
@pytest.mark.timeout(120)
def test_mismatched_packages_fail_at_start(make_tiny: Callable[..., Tiny]) -> None:
    a, b = make_tiny(stages=2, microbatches=4), make_tiny(stages=2, microbatches=2)
    ranks = launch(2, "fault", [a.dir, b.dir], a.dir.parent / "tiny.py")
    for rank in ranks:
        assert rank.rc == 3 and "the ranks run different packages" in rank.err, rank.err[-2000:]


def test_world_size_must_match_the_mesh(make_tiny: Callable[..., Tiny], monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked before joining the process group (so this runs in-process, joining nothing)."""
    t = make_tiny(stages=2)
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(MeshError, match=r"planned for pp=2 x tp=1 x dp=1 = 2 ranks but WORLD_SIZE is 3: launch 2 "
                                        r"processes \(--nproc 2\)"):
        runtime.DistributedPipeline(t.dir)


@multiproc
@pytest.mark.timeout(120)
@pytest.mark.slow
def test_a_silent_rank_times_out(make_tiny: Callable[..., Tiny]) -> None:
    t = make_tiny(stages=2, schedule="gpipe", microbatches=2)
    ranks = launch(2, "fault", [t.dir], t.dir.parent / "tiny.py",
                   env={"PIPELINE_FAULT": "1:1B0:hang", "PIPELINE_TIMEOUT_S": "2"})
    assert ranks[0].rc == 3 and ranks[1].rc == -9, ranks[0].err[-2000:]
    assert re.search(r"rank 0 \(stage 0\) timed out in RECV_B from stage 1, microbatch 0: rank 1 stopped or failed "
                     r"\(.+\)\. .*raise PIPELINE_TIMEOUT_S \(now 2 s\)", ranks[0].err), ranks[0].err


def test_a_stage_off_its_schedules_placement_is_refused(make_tiny: Callable[..., Tiny]) -> None:
    """A zb-v package whose stages list round-robin ranks (stage 2 on rank 0, not on rank 1
    at the turn of the V) is refused before any message goes to the wrong rank."""
    m = package.load_manifest(make_tiny(stages=4, schedule="zb-v", virtual_stages=2).dir)
    graph = StageGraph.from_manifest(m)
    _check_ranks(m, Mesh.from_manifest(m), graph)  # as written: [0], [1], [1], [0]
    round_robin = dataclasses.replace(m, stages=tuple(dataclasses.replace(s, ranks=(s.index % 2,)) for s in m.stages))
    with pytest.raises(ManifestError, match=r"stage 2 lists ranks \[0\] but this runtime places it on \[1\] .*zb-v"):
        _check_ranks(round_robin, Mesh.from_manifest(m), graph)


@multiproc
@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule, dp", [("zb-h1", 1), ("zb-h2", 2), ("zb-v", 1)])
def test_zero_bubble_schedules(make_tiny: Callable[..., Tiny], schedule: str, dp: int) -> None:
    # B split in I and W ([Note: split backward] in runtime/stage.py): the reference's
    # gradients; with dp = 2 the gradient buckets are armed before each parameter's last W.
    # zb-v: 4 stages on 2 ranks in a V, the tied weight's two copies both on rank 0
    v = 2 if schedule == "zb-v" else 1
    t = make_tiny(stages=2 * v, schedule=schedule, microbatches=4, dp=dp, virtual_stages=v)
    _ok(launch(2 * dp, "check", [t.dir], t.dir.parent / "tiny.py"))


def test_a_process_group_the_runtime_started_is_closed_at_exit() -> None:
    """init_from_env registers the group's closing for the interpreter's exit (left to the
    teardown, gloo's threads sometimes aborted a rank after training); a group the caller
    closed first is left alone."""
    script = (
        "import atexit, torch.distributed as dist\n"
        "from runtime import comm\n"
        "hooks = []\n"
        "atexit.register = hooks.append\n"
        "comm.init_from_env(10.0)\n"
        "assert dist.is_initialized() and hooks == [comm._close_process_group], hooks\n"
        "hooks[0]()\n"
        "assert not dist.is_initialized()\n"
        "hooks[0]()\n"
        "print('closed')\n"
    )
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "1", "RANK": "0",
           "PIPELINE_CPU_BIND": "0", "PIPELINE_CPU_MALLOC": "0"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0 and "closed" in proc.stdout, proc.stderr[-2000:]
