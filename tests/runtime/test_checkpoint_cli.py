"""`partitioner run --checkpoint DIR --save-every K --resume --init --load PATH` and
`partitioner export CKPT --out DIR`: option checks in process, one save-and-resume through torchrun."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file

import runtime
from driver.cli import main as cli
from runtime import launch
from runtime.errors import CheckpointError

from ..conftest import ROOT
from .conftest import Tiny


def test_checkpoint_options_are_checked(make_tiny: Callable[..., Tiny], capsys: pytest.CaptureFixture[str]) -> None:
    pkg = str(make_tiny(stages=2).dir)
    with pytest.raises(CheckpointError, match=r"--save-every, --keep and --resume need --checkpoint DIR"):
        launch.main([pkg, "--nproc", "2", "--save-every", "2"])
    with pytest.raises(CheckpointError, match=r"--load nowhere does not exist: give a checkpoint folder, a "
                                              r"\.safetensors file or a Hugging Face model folder"):
        launch.main([pkg, "--nproc", "2", "--load", "nowhere"])
    assert cli(["run", pkg, "--nproc", "2", "--resume"]) == 2
    assert "need --checkpoint DIR" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        launch.main([pkg, "--nproc", "2", "--init", "--load", pkg])
    assert cli(["export", pkg, "--out", pkg + "-x"]) == 2
    assert "is incomplete" in capsys.readouterr().err


def _run(cwd: Path, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PIPELINE_TIMEOUT_S": "30"}
    proc = subprocess.Popen([sys.executable, "-m", "partitioner", "run", "pkg", "--nproc", "2", "--lr", "0.1", *args],
                            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    assert proc.returncode == 0, out[-3000:]
    return out


@pytest.mark.multiproc
@pytest.mark.timeout(250)
def test_run_saves_resumes_and_exports(make_tiny: Callable[..., Tiny], tmp_path: Path) -> None:
    t = make_tiny(stages=2, microbatches=2)
    cwd = t.dir.parent
    first = _run(cwd, "--steps", "3", "--checkpoint", "ck", "--save-every", "2", "--keep", "2", "--init")
    assert sorted(p.name for p in (cwd / "ck").iterdir()) == ["step-000002", "step-000003"]
    second = _run(cwd, "--steps", "5", "--checkpoint", "ck", "--save-every", "2", "--resume", "--keep", "2")
    assert "after step 3" in second
    got = [float(x) for x in re.findall(r"^step \d+  loss (\d+\.\d{6})", first + second, re.M)]
    # the same: init_weights and 5 SGD steps in one process
    pipe = runtime.LocalPipeline(t.dir)
    pipe.init_weights(seed=0)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    want = []
    for _ in range(5):
        opt.zero_grad()
        want.append(pipe.train_step(*t.batch()).item())
        opt.step()
    assert got == pytest.approx(want, rel=1e-5, abs=2e-6), first + second
    assert sorted(p.name for p in (cwd / "ck").iterdir()) == ["step-000004", "step-000005"]
    assert cli(["export", str(cwd / "ck" / "step-000005"), "--out", str(tmp_path / "out")]) == 0
    exported, final = load_file(tmp_path / "out" / "model.safetensors"), pipe.state_dict()
    assert set(exported) == set(final)
    for name, value in final.items():
        torch.testing.assert_close(exported[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_resume_with_nothing_to_resume_is_refused(make_tiny: Callable[..., Tiny], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """--resume on a folder that does not exist or holds no complete checkpoint: exit 2 before
    any rank starts; --resume-if-any starts afresh there and hands the workers the same choice."""
    pkg = str(make_tiny(stages=2).dir)
    started: list[list[str]] = []
    monkeypatch.setattr(launch.subprocess, "call", lambda cmd, env: started.append(cmd) or 0)
    typo = str(tmp_path / "chekpoints")
    assert cli(["run", pkg, "--nproc", "2", "--checkpoint", typo, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "chekpoints' does not exist" in err and "--resume-if-any" in err and "Traceback" not in err, err
    (tmp_path / "empty" / ".step-000002.partial").mkdir(parents=True)  # a save that never finished
    assert cli(["run", pkg, "--nproc", "2", "--checkpoint", str(tmp_path / "empty"), "--resume"]) == 2
    assert "holds no complete checkpoint" in capsys.readouterr().err
    assert not started
    for root in (typo, str(tmp_path / "empty")):
        assert cli(["run", pkg, "--nproc", "2", "--checkpoint", root, "--resume-if-any"]) == 0
        assert started.pop()[-1] == "--resume-if-any"  # the workers make the same choice
    with pytest.raises(SystemExit):
        launch.main([pkg, "--nproc", "2", "--checkpoint", typo, "--resume", "--resume-if-any"])


@pytest.mark.parametrize("flag", ["--resume", "--resume-if-any"])
def test_the_worker_resumes_or_starts_afresh(flag: str, tmp_path: Path) -> None:
    """runtime._worker's side: the step to go on after, or the same refusal."""
    from runtime.checkpoint import run as checkpointing

    class Pipe:
        rank = 0

        def load_checkpoint(self, path: Path, optimizer: object = None) -> dict[str, int]:
            return {"step": int(path.name.split("-")[1])}

    parser = __import__("argparse").ArgumentParser()
    checkpointing.add_arguments(parser)
    ns = parser.parse_args(["--checkpoint", str(tmp_path / "ck"), flag])
    ns.steps = 5
    if flag == "--resume":
        with pytest.raises(CheckpointError, match=r"checkpoint folder .*ck' does not exist .* pass --resume-if-any"):
            checkpointing.resume(Pipe(), None, ns)
    else:
        assert checkpointing.resume(Pipe(), None, ns) == 0
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "step-000003").mkdir()
    (tmp_path / "ck" / "step-000003" / "COMPLETE.json").write_text("{}")  # not a valid marker: skipped
    if flag == "--resume":
        with pytest.raises(CheckpointError, match=r"holds no complete checkpoint .* check the --checkpoint path"):
            checkpointing.resume(Pipe(), None, ns)
    else:
        assert checkpointing.resume(Pipe(), None, ns) == 0


def test_a_fresh_run_in_a_folder_of_checkpoints_is_refused(make_tiny: Callable[..., Tiny], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """--checkpoint D holding another run's checkpoints, without --resume: exit 2 before any
    rank starts; --overwrite removes them (complete and unfinished ones) and nothing else,
    and only once the run has passed every check."""
    t = make_tiny(stages=2)
    pkg, ck = str(t.dir), tmp_path / "ck"
    started: list[list[str]] = []
    monkeypatch.setattr(launch.subprocess, "call", lambda cmd, env: started.append(cmd) or 0)
    runtime.LocalPipeline(pkg).save_checkpoint(ck / "step-000003")
    (ck / ".step-000004.partial").mkdir()  # a save that never finished
    (ck / "notes.txt").write_text("mine")
    assert cli(["run", pkg, "--nproc", "2", "--checkpoint", str(ck)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "another run's checkpoints" in err and "step-000003" in err and "--resume" in err, err
    assert "--overwrite" in err and "Traceback" not in err
    assert cli(["run", pkg, "--nproc", "2", "--checkpoint", str(ck), "--overwrite", "--resume"]) == 2
    assert not started and (ck / "step-000003").is_dir()
    assert cli(["run", pkg, "--nproc", "2", "--checkpoint", str(ck), "--resume"]) == 0
    assert cli(["run", pkg, "--nproc", "3", "--checkpoint", str(ck), "--overwrite"]) == 2  # refused: nothing removed
    assert (ck / "step-000003").is_dir() and len(started) == 1
    assert cli(["run", pkg, "--nproc", "2", "--checkpoint", str(ck), "--overwrite"]) == 0
    assert "--overwrite" not in started[-1] and "--resume" not in started[-1]  # the workers start afresh
    assert sorted(p.name for p in ck.iterdir()) == ["notes.txt"]
    (ck / "step-000002").mkdir()  # not a checkpoint the project saved, where a save would go
    assert cli(["run", pkg, "--nproc", "2", "--checkpoint", str(ck), "--overwrite"]) == 2
    assert "step-000002, not checkpoints this project saved" in " ".join(capsys.readouterr().err.split())
    assert sorted(p.name for p in ck.iterdir()) == ["notes.txt", "step-000002"] and len(started) == 2


def test_export_never_deletes_what_it_did_not_write(make_tiny: Callable[..., Tiny], tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """export --out: a folder of other files is refused (exit 2) and, with --force, gets the
    export beside them, never over a file of the same name; an earlier export (its stamp)
    is replaced whole, its shards included."""
    pipe = runtime.LocalPipeline(str(make_tiny(stages=2).dir))
    pipe.save_checkpoint(tmp_path / "ck")
    mine = tmp_path / "mydata"
    mine.mkdir()
    (mine / "important.txt").write_text("mine")
    (mine / "model.safetensors").write_text("my weights")
    export = ["export", str(tmp_path / "ck"), "--out", str(mine)]
    assert cli(export) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "important.txt, model.safetensors" in err and "--force" in err and "Traceback" not in err, err
    assert cli([*export, "--force"]) == 2
    assert "model.safetensors, which the export would overwrite" in " ".join(capsys.readouterr().err.split())
    assert (mine / "model.safetensors").read_text() == "my weights"
    (mine / "model.safetensors").unlink()
    assert cli([*export, "--force"]) == 0
    assert (mine / "important.txt").read_text() == "mine" and set(load_file(mine / "model.safetensors")) == set(
        pipe.state_dict())
    out = tmp_path / "st"
    assert cli(["export", str(tmp_path / "ck"), "--out", str(out), "--max-shard-size", "100B"]) == 0
    assert (out / "model.safetensors.index.json").is_file()
    assert cli(["export", str(tmp_path / "ck"), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == [".partitioner-export.json", "model.safetensors"]
