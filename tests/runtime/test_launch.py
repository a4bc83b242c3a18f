"""`partitioner run` (runtime.launch): argument checks in-process, one real torchrun launch."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

from runtime import launch
from runtime.errors import ManifestError, MeshError
from runtime.manifest import read_manifest
from runtime.tracing import COLLECTIVES, OPTIMIZER

from .conftest import Tiny

ROOT = Path(__file__).resolve().parents[2]


def test_nproc_must_match_the_mesh(make_tiny: Callable[..., Tiny]) -> None:
    t = make_tiny(stages=2, dp=2, microbatches=2)
    with pytest.raises(MeshError, match=r"planned for pp=2 x tp=1 x dp=2 = 4 ranks but --nproc is 2: run it with --nproc 4"):
        launch.main([str(t.dir), "--nproc", "2"])


def test_model_file_must_be_trainable(make_tiny: Callable[..., Tiny]) -> None:
    t = make_tiny(stages=2)
    model = t.dir.parent / "tiny.py"
    model.write_text(model.read_text().replace("def example_target", "def _no_target"))
    with pytest.raises(ManifestError, match=r"defines no example_target\(\), which `partitioner run` needs"):
        launch.main([str(t.dir), "--nproc", "2"])


def test_ranks_sharing_cores_are_told(make_tiny: Callable[..., Tiny], monkeypatch: pytest.MonkeyPatch,
                                      capfd: pytest.CaptureFixture[str]) -> None:
    """4 CPU ranks on 2 cores take turns, so their steps take longer than the plan says:
    the launcher says so in one line before torchrun starts; on 4 cores, nothing."""
    t = make_tiny(stages=2, dp=2, microbatches=2)
    step_ms = read_manifest(t.dir).predicted.step_time_s * 1e3  # type: ignore[union-attr]
    started: list[list[str]] = []
    monkeypatch.setattr(launch.subprocess, "call", lambda cmd, **_: started.append(cmd) or 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for cores in ({0, 1}, {0, 1, 2, 3}):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, cores=cores: cores)
        assert launch.main([str(t.dir), "--nproc", "4", "--steps", "1"]) == 0
    assert len(started) == 2
    assert capfd.readouterr().err == (
        f"partitioner run: 4 ranks share the 2 cores this run may use (os.sched_getaffinity), so they take turns on "
        f"them and each step takes longer than the plan's prediction ({step_ms:.1f} ms), which gives every rank a "
        f"core of its own: run it where it may use 4 cores or more, or compile for 2 devices (--devices 2).\n")


def test_torchrun_command() -> None:
    cmd = launch.torchrun_command("/p", 4, 5, 0.01, "/t.json")
    assert cmd[1:6] == ["-m", "runtime._torchrun", "--standalone", "--nproc-per-node=4", "-m"]
    assert cmd[6:] == ["runtime._worker", "/p", "--steps", "5", "--lr", "0.01", "--trace", "/t.json"]


@pytest.mark.multiproc
@pytest.mark.timeout(150)
def test_run_trains_and_traces(make_tiny: Callable[..., Tiny]) -> None:
    t = make_tiny(stages=2, schedule="1f1b", microbatches=2)
    trace = t.dir.parent / "trace.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PIPELINE_TIMEOUT_S": "30"}
    proc = subprocess.Popen([sys.executable, "-m", "runtime.launch", "pkg", "--nproc", "2", "--steps", "2", "--lr", "0.1",
                             "--trace", str(trace)], cwd=t.dir.parent, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    assert proc.returncode == 0, out[-3000:]
    got = [float(x) for x in re.findall(r"^step \d+  loss (\d+\.\d{6})  time \d+\.\d ms$", out, re.M)]
    # the same two SGD steps on the original model
    model = t.build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    want = []
    for _ in range(2):
        opt.zero_grad()
        loss = t.loss_fn(model(*t.batch()[0]), t.batch()[1])
        loss.backward()
        opt.step()
        want.append(loss.item())
    assert got == pytest.approx(want, rel=1e-5, abs=2e-6), out
    # after the second step only (the steady state), each rank's measured memory beside the plan's
    # (runtime/memory.py), and a line where the plan counted another optimizer's state
    memory = re.findall(r"^memory rank (\d)  measured .* \(parameters .*\); predicted .*$", out, re.M)
    assert memory == ["0", "1"], out
    assert out.index("step 2 ") < out.index("memory rank 0"), out
    planned = read_manifest(t.dir).options.get("optimizer", "adam")  # a package made without the driver: adam
    assert (f"the plan counts {planned}'s optimizer state; this run's sgd keeps none" in out) == (planned != "sgd"), out
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    assert {e["cat"] for e in spans} == {"F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "collective", "optimizer"}
    # every rank: its loss all_reduce and one optimizer step per training step, on their own rows
    for rank in (0, 1):
        mine = [e for e in spans if e["pid"] == rank]
        assert sorted(e["args"]["step"] for e in mine if e["name"] == "loss all_reduce") == [0, 1]
        assert sorted(e["args"]["step"] for e in mine if e["name"] == "optimizer step") == [0, 1]
        assert {e["tid"] for e in mine if e["cat"] in ("collective", "optimizer")} == {COLLECTIVES, OPTIMIZER}
    assert {(e["args"]["step"], e["args"]["microbatch"]) for e in spans if e["name"] == "1F1"} == {(0, 1), (1, 1)}
