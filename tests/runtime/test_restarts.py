"""`partitioner run --max-restarts R` ([Note: restarts]) and the faults it survives, injected by
PARTITIONER_FAULT ([Note: injected faults]): a rank killed mid-step, killed during a save, hung
(SIGSTOP), a corrupt checkpoint met at a restart, and a full disk at a save ([Note: a full disk
at a save]); each 2-rank run's final weights against an uninterrupted run's."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

import runtime
from driver.cli import main as cli
from runtime import faults, restarts
from runtime.checkpoint import space
from runtime.checkpoint.commit import partial_dir
from runtime.errors import CheckpointError, PipelineError
from runtime.schedule import Action

from ..conftest import ROOT
from .conftest import write_package

STEPS = ["--steps", "6", "--save-every", "2", "--optimizer", "adamw", "--lr", "0.05", "--init"]


# -- in process -----------------------------------------------------------------------------------


def test_fault_spec_is_checked_and_fires_only_at_its_step_and_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(PipelineError, match=r"write KIND:rank=R:step=S\[:attempt=A\] with KIND one of kill, hang"):
        faults.parse_step_faults("kill:rank=1")
    monkeypatch.setenv(faults.FAULT_ENV, "enospc:rank=1:step=4:attempt=2")
    hooks = faults.from_env()
    assert isinstance(hooks, faults.StepFaults)
    hooks.at_save(1, 4, Path("x"))  # attempt 1: not yet
    monkeypatch.setenv(faults.ATTEMPT_ENV, "2")
    hooks.at_save(0, 4, Path("x"))  # another rank
    hooks.check(1, Action.from_str("1B0"), 4)  # not a save fault
    with pytest.raises(OSError) as info:
        hooks.at_save(1, 4, Path("ck/.step-000004.partial/train"))
    assert info.value.errno == errno.ENOSPC and info.value.filename == "ck/.step-000004.partial/train"


def test_a_full_disk_is_found_behind_dcp_and_told_with_the_fix(tmp_path: Path) -> None:
    (tmp_path / "step-000002").mkdir()
    (tmp_path / "step-000002" / "w").write_bytes(b"x" * 3 * 2**20)
    (tmp_path / "step-000002" / "COMPLETE.json").write_text(json.dumps({"saved_at": 1.0, "files": {"w": 3 * 2**20}}))
    tmp = partial_dir(tmp_path / "step-000004")
    tmp.mkdir()
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp / "train"))
    wrapped = CheckpointException("write", {1: (full, traceback.StackSummary())})  # as DCP hands a rank's failure to every rank
    assert space.disk_full(wrapped) is full and space.disk_full(CheckpointException("write", {})) is None
    message = str(space.space_error(tmp_path / "step-000004", tmp, full, coordinator=True))
    assert not tmp.exists()
    for part in (f"no space left on the device saving checkpoint {tmp_path / 'step-000004'} (writing {tmp}/train)",
                 f"it needs about 3.0 MiB (the size of {tmp_path / 'step-000002'})", "is free there",
                 f"{tmp_path / 'step-000002'} stays the newest complete checkpoint", "--keep N"):
        assert part in message, message


def test_a_failure_is_named_and_a_user_error_is_not_restarted() -> None:
    torchrun = "Root Cause (first observed failure):\n[0]:\n  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 7)"
    killed = restarts.failure(1, {0: {"pid": 1, "step": 3}, 1: {"pid": 2, "step": 3}}, torchrun)
    assert str(killed) == "attempt 1: rank 1 at step 3: killed by signal 9 (SIGKILL)" and killed.retry
    peer = {"pid": 1, "step": 5, "error": "rank 0 timed out ...: rank 1 stopped", "fault": True}
    hung = restarts.failure(3, {0: peer}, torchrun.replace(": 1 (", ": 0 (").replace("-9", "2"))
    assert str(hung) == "attempt 3: rank 0 at step 5: rank 0 timed out ...: rank 1 stopped" and hung.retry
    first_seen = ("Failures:\n[1]:\n  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 7)\nRoot Cause (first "
                  "observed failure):\n[0]:\n  rank      : 0 (local_rank: 0)\n  exitcode  : 3 (pid: 6)")
    saving = {"pid": 1, "step": 4, "error": "rank 0 failed saving checkpoint", "fault": True}
    killed = restarts.failure(2, {0: saving, 1: {"pid": 2, "step": 4}}, first_seen)  # torchrun saw rank 0 first
    assert str(killed) == "attempt 2: rank 1 at step 4: killed by signal 9 (SIGKILL)", (killed, first_seen)
    user = restarts.failure(1, {0: peer, 1: {"pid": 2, "step": 1, "error": "bad batch", "fault": False}}, torchrun)
    assert (user.rank, user.what, user.retry) == (1, "bad batch", False)


def test_a_hang_is_blamed_on_the_rank_whose_heartbeat_stopped(tmp_path: Path) -> None:
    """[Note: heartbeats]: rank 1 stopped; rank 0's wait timed out first and rank 2's after it;
    the watcher notes rank 1's old beat when rank 0 reports, and the failure names rank 1."""
    statuses = {0: {"pid": os.getpid(), "step": 5, "error": "rank 0 timed out in RECV_B: rank 1 stopped", "fault": True,
                    "at": 10.0},
                1: {"pid": os.getpid(), "step": 5},
                2: {"pid": os.getpid(), "step": 5, "error": "rank 2 timed out in RECV_F: rank 1 stopped", "fault": True,
                    "at": 11.0}}
    for rank in (0, 1, 2):
        (tmp_path / f"rank-{rank}.beat").touch()
    old = time.time() - 20
    os.utime(tmp_path / "rank-1.beat", (old, old))
    (tmp_path / "rank-0.json").write_text(json.dumps(statuses[0]))
    done = threading.Event()
    watcher = threading.Thread(target=restarts.watch, args=(tmp_path, done))
    watcher.start()
    for _ in range(600):  # the watcher notes the stalled ranks within its first poll or two
        if "stalled" in restarts.records(tmp_path):
            break
        time.sleep(0.1)
    done.set()
    watcher.join(5)
    record = restarts.records(tmp_path)
    assert set(record["stalled"]) == {1} and 19 < record["stalled"][1] < 60, record
    record.update(exits={0: 2, 1: -15, 2: -15}, first=(0, 2))  # as torchrun's wrapper writes them
    hung = restarts.failure(3, statuses, "", record)
    assert str(hung) == ("attempt 3: rank 1 at step 5: stopped making progress (no heartbeat for 20 s); rank 0's "
                         "error came from waiting on it") and hung.retry, hung
    killed = restarts.failure(3, statuses, "", {**record, "exits": {0: 2, 1: -9, 2: -15}})  # not a hang: a kill
    assert str(killed) == "attempt 3: rank 1 at step 5: killed by signal 9 (SIGKILL)", killed
    user = {**statuses, 1: {"pid": 1, "step": 5, "error": "bad batch", "fault": False}}
    assert restarts.failure(3, user, "", record).what == "bad batch"  # and a rank's own error before both


def test_the_rank_errors_are_told_once_after_the_peers_failures(tmp_path: Path, capfd: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's wrapper: the same message from several ranks once, a rank's own error last,
    and the failure only where it names a rank that said nothing (killed, or hung)."""
    monkeypatch.delenv(restarts.LEFT_ENV, raising=False)
    own = "step 2: the loss (nan) is not finite"
    peer = "rank 2 (stage 1) failed in RECV_F from stage 0: rank 0 stopped or failed"
    for rank, message, fault in ((0, own, False), (1, own, False), (2, peer, True)):
        (tmp_path / f"rank-{rank}.json").write_text(json.dumps({"pid": 1, "step": 2, "error": message, "fault": fault}))
    restarts.tell(tmp_path, {0: 2, 1: 2, 2: 2}, (0, 2))
    assert capfd.readouterr().err == f"rank 2: error: {peer}\nranks 0, 1: error: {own}\n"
    (tmp_path / "rank-0.json").write_text(json.dumps({"pid": 1, "step": 2}))
    (tmp_path / "rank-1.json").write_text(json.dumps({"pid": 1, "step": 2}))
    restarts.tell(tmp_path, {0: -9, 2: 2}, (2, 2))  # a rank killed: said last, as the failure
    assert capfd.readouterr().err == (f"rank 2: error: {peer}\npartitioner run: rank 0 at step 2: killed by signal 9 "
                                      f"(SIGKILL)\n")
    restarts.tell(tmp_path, {0: -15, 2: 2}, (2, 2))  # rank 2's own report names the failure: said once
    assert capfd.readouterr().err == f"rank 2: error: {peer}\n"
    (tmp_path / "stalled.json").write_text(json.dumps({"0": 7.2}))  # as the watcher notes a hung rank 0
    (tmp_path / "rank-0.json").write_text(json.dumps({"pid": 1, "step": 2, "error": "woken, its peers gone",
                                                      "fault": True}))
    restarts.tell(tmp_path, {0: 2, 2: 2}, (2, 2))
    assert capfd.readouterr().err == (f"rank 2: error: {peer}\npartitioner run: rank 0 at step 2: stopped making "
                                      f"progress (no heartbeat for 7 s); rank 2's error came from waiting on it\n")


# a stand-in for one torchrun: fails attempt 1 as a rank killed at step 3 would, or with a user error
FAKE = """
import json, os, sys
from pathlib import Path
folder, attempt = Path(os.environ["PARTITIONER_STATUS_DIR"]), os.environ["PARTITIONER_ATTEMPT"]
print("attempt", attempt, "left", os.environ["PARTITIONER_RESTARTS_LEFT"], sys.argv[1:], file=sys.stderr)
if sys.argv[1] == "user":
    (folder / "rank-0.json").write_text(json.dumps({"pid": 1, "step": 1, "error": "bad batch", "fault": False}))
    sys.exit(1)
if attempt == "1":
    (folder / "rank-1.json").write_text(json.dumps({"pid": 1, "step": 3}))
    (Path(sys.argv[2]) / ".step-000004.partial").mkdir()
    print("Root Cause (first observed failure):\\n  rank      : 1 (local_rank: 1)\\n  exitcode  : -9 (pid: 1)",
          file=sys.stderr)
    sys.exit(1)
"""


def test_a_failed_attempt_restarts_after_cleaning_partial_saves(tmp_path: Path, capfd: pytest.CaptureFixture[str]
                                                                ) -> None:
    def command(attempt: int) -> list[str]:
        return [sys.executable, "-c", FAKE, "ok", str(tmp_path), str(attempt)]

    assert restarts.run_attempts(command, dict(os.environ), 2, tmp_path) == 0
    err = capfd.readouterr().err
    assert "attempt 1 left 2" in err and "attempt 2 left 1" in err and "attempt 3" not in err, err
    assert f"removed {tmp_path / '.step-000004.partial'}, a checkpoint whose save did not finish" in err
    assert not partial_dir(tmp_path / "step-000004").exists()
    assert "finished after 1 fault(s) survived:\n  attempt 1: rank 1 at step 3: killed by signal 9 (SIGKILL)" in err
    assert restarts.run_attempts(lambda a: [sys.executable, "-c", FAKE, "user"], dict(os.environ), 2, tmp_path) == 1
    err = capfd.readouterr().err
    assert "attempt 2" not in err and "attempt 1: rank 0 at step 1: bad batch\n  not restarted" in err, err
    with open(tmp_path / restarts.LOCK, "w") as held:  # another run holds the folder
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(CheckpointError, match=r"is in use by another `partitioner run`"):
            restarts.run_attempts(command, dict(os.environ), 1, tmp_path)


def test_max_restarts_needs_a_checkpoint_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pkg = str(write_package(tmp_path, stages=2, microbatches=2))
    assert cli(["run", pkg, "--nproc", "2", "--max-restarts", "2"]) == 2
    assert "--max-restarts 2 needs --checkpoint DIR" in capsys.readouterr().err


# -- 2-rank jobs through torchrun ---------------------------------------------------------------


def _run(cwd: Path, *args: str, fault: str = "", ok: bool = True) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PIPELINE_TIMEOUT_S": "12",
           faults.FAULT_ENV: fault}
    proc = subprocess.Popen([sys.executable, "-m", "partitioner", "run", "pkg", "--nproc", "2", *STEPS, *args],
                            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    assert (proc.returncode == 0) == ok, out[-4000:]
    return out


def _weights(pkg: Path, checkpoint: Path) -> dict[str, Any]:
    pipe = runtime.LocalPipeline(pkg)
    pipe.load_checkpoint(checkpoint)
    return pipe.state_dict()


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=0, msg=lambda m: f"{name}: {m}")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The final weights of the run with no fault."""
    root = tmp_path_factory.mktemp("uninterrupted")
    write_package(root, stages=2, microbatches=2)
    _run(root, "--checkpoint", "ck")
    return _weights(root / "pkg", root / "ck" / "step-000006")


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(420)
def test_a_job_survives_a_kill_a_kill_during_a_save_and_a_hang(uninterrupted: dict[str, Any], tmp_path: Path
                                                              ) -> None:
    """Attempt 1: rank 1 SIGKILLs itself mid-step 3 (after its forward, before its backward);
    2: it is killed saving step 4, so step 2 stays the newest and step 4's partial folder is
    removed before attempt 3; 3: step 4's save is corrupted once written, then rank 1 SIGSTOPs
    itself in step 5, rank 0's wait times out and the summary blames rank 1, whose heartbeat
    stopped; 4: from step 2 (step 4's checkpoint is
    corrupt) to the end.  The weights are the uninterrupted run's."""
    pkg = write_package(tmp_path, stages=2, microbatches=2)
    out = _run(tmp_path, "--checkpoint", "ck", "--max-restarts", "3",
               fault="kill:rank=1:step=3,save-kill:rank=1:step=4:attempt=2,corrupt:rank=0:step=4:attempt=3,"
                     "hang:rank=1:step=5:attempt=3")
    ck = tmp_path / "ck"
    for rank in (0, 1):
        assert f"rank {rank}: attempt 2: resumed from {ck / 'step-000002'} after step 2; 2 restarts left" in out, out
        assert f"rank {rank}: attempt 3: resumed from {ck / 'step-000002'} after step 2; 1 restarts left" in out
        assert f"rank {rank}: attempt 4: resumed from {ck / 'step-000002'} after step 2; 0 restarts left" in out
    assert f"checkpoint {ck / 'step-000004'} is corrupt (" in out  # attempt 4 passes over it
    assert f"removed {ck / '.step-000004.partial'}, a checkpoint whose save did not finish" in out
    summary = out[out.index("finished after 3 fault(s) survived:"):]
    assert "\n  attempt 1: rank 1 at step 3: killed by signal 9 (SIGKILL)" in summary, summary
    assert "\n  attempt 2: rank 1 at step 4: killed by signal 9 (SIGKILL)" in summary, summary
    assert re.search(r"\n  attempt 3: rank 1 at step 5: stopped making progress \(no heartbeat for \d+ s\); rank 0's "
                     r"error came from waiting on it\n", summary), summary
    assert "rank 0: error: rank 0 (stage 0) timed out in RECV_B from stage 1, microbatch 0: rank 1 stopped" in out
    assert sorted(p.name for p in ck.iterdir()) == [restarts.LOCK, "step-000002", "step-000004", "step-000006"]
    _same(_weights(pkg, ck / "step-000006"), uninterrupted)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_full_disk_at_a_save_is_told_and_training_goes_on(uninterrupted: dict[str, Any], tmp_path: Path) -> None:
    """Rank 1's writer raises ENOSPC saving step 4: every rank abandons that save, rank 0 says
    which path and the fix, training goes on and the last save is the uninterrupted run's."""
    pkg = write_package(tmp_path, stages=2, microbatches=2)
    out = _run(tmp_path, "--checkpoint", "ck", fault="enospc:rank=1:step=4")
    ck = tmp_path / "ck"
    assert f"no space left on the device saving checkpoint {ck / 'step-000004'} (writing " in out, out
    assert f"{ck / 'step-000002'} stays the newest complete checkpoint" in out
    assert "Training goes on; the next save tries again." in out and "Traceback" not in out
    assert sorted(p.name for p in ck.iterdir()) == ["step-000002", "step-000006"]
    _same(_weights(pkg, ck / "step-000006"), uninterrupted)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(200)
def test_a_hang_without_restarts_is_blamed_on_the_rank_that_hung(tmp_path: Path) -> None:
    """Rank 1 SIGSTOPs itself in step 2 and rank 0's wait times out: the run ends with rank 0's
    error and then the failure, which names rank 1, and no launcher traceback."""
    write_package(tmp_path, stages=2, microbatches=2)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PIPELINE_TIMEOUT_S": "6",
           faults.FAULT_ENV: "hang:rank=1:step=2"}
    proc = subprocess.Popen([sys.executable, "-m", "partitioner", "run", "pkg", "--nproc", "2", "--steps", "3"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    assert proc.returncode == 1, out[-4000:]
    lines = out.rstrip().splitlines()
    assert lines[-2].startswith("rank 0: error: rank 0 (stage 0) timed out in RECV_B from stage 1"), out
    assert re.fullmatch(r"partitioner run: rank 1 at step 2: stopped making progress \(no heartbeat for \d+ s\); "
                        r"rank 0's error came from waiting on it", lines[-1]), out
    assert "Traceback" not in out and "ChildFailedError" not in out and "rank 1: error" not in out, out
