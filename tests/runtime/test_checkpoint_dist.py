"""Checkpoints of DistributedPipeline in real processes (gloo on 127.0.0.1): written in parallel
by every rank, resumed bit for bit on the same plan and to 1e-5 on another (tp, dp, or
LocalPipeline with other stages), and a rank SIGKILLed in the middle of a save leaves the
previous checkpoint loadable and the partial one refused; init_weights on tensor-parallel
ranks (checkpoint_worker.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import runtime
from runtime import package
from runtime.checkpoint.commit import partial_dir
from runtime.errors import CheckpointError

from .test_distributed import _free_port
from .tp_package import write_tp_package

WORKER = Path(__file__).with_name("checkpoint_worker.py")
RTOL, ATOL = 1e-5, 1e-6


def _launch(n: int, phase: str, pkg: Path, root: Path, env: dict[str, str] | None = None) -> tuple[dict[int, int], Path]:
    """Run n ranks of checkpoint_worker.py; kill them all at a deadline; (exit codes, outdir)."""
    outdir = root.parent / f"ranks-{phase}-{pkg.parent.name}"
    outdir.mkdir()
    full = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(n),
            "OMP_NUM_THREADS": "1", "PIPELINE_TIMEOUT_S": "20", **(env or {})}
    proc = subprocess.Popen([sys.executable, str(WORKER), str(n), phase, str(outdir), str(pkg), str(root)], env=full,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        summary, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        summary, _ = proc.communicate()
    codes = {int(line.split()[1].rstrip(":")): int(line.split()[2]) for line in summary.splitlines()
             if line.startswith("rank ")}
    return codes, outdir


def _err(outdir: Path, r: int) -> str:
    path = outdir / f"rank{r}.err"
    return path.read_text() if path.exists() else ""


def _ok(codes: dict[int, int], outdir: Path, n: int) -> dict[str, object]:
    for r in range(n):
        assert codes.get(r) == 0, f"rank {r} exited {codes.get(r)}:\n{_err(outdir, r)[-3000:]}"
    return torch.load(outdir / "result.pt")  # type: ignore[no-any-return]


@pytest.mark.multiproc
def test_save_crash_resume_on_two_ranks(tmp_path: Path) -> None:
    """TpNet on 2 stages (its embedding tied to the head across the two ranks)."""
    pkg, root = write_tp_package(tmp_path / "pp2", stages=2, tp=1), tmp_path / "ckpts"
    saved = _ok(*_launch(2, "save", pkg, root), 2)
    # 1. rank 1 is killed in the middle of saving step-4: step-3 stays, the partial one is refused
    codes, outdir = _launch(2, "crash", pkg, root, env={"PIPELINE_CHECKPOINT_FAULT": "1"})
    assert codes[1] == -signal.SIGKILL and codes[0] == 3, codes
    assert "failed saving checkpoint" in _err(outdir, 0) and "is as it was before this save" in _err(outdir, 0)
    assert not (root / "step-4").exists() and partial_dir(root / "step-4").is_dir()
    with pytest.raises(CheckpointError, match=r"\.step-4\.partial is incomplete: .*COMPLETE.json is missing"):
        runtime.LocalPipeline(pkg).load_checkpoint(partial_dir(root / "step-4"))
    # 2. the same plan resumes from the newest complete checkpoint bit for bit
    resumed = _ok(*_launch(2, "resume", pkg, root), 2)
    assert all(torch.equal(a, b) for a, b in zip(resumed["losses"], saved["losses"])), (resumed, saved)  # type: ignore
    want: dict[str, torch.Tensor] = saved["state_dict"]  # type: ignore[assignment]
    for name, value in resumed["state_dict"].items():  # type: ignore[attr-defined]
        assert torch.equal(value, want[name]), name
    # 3. in one process, another plan (the whole model in one stage) loads what 2 ranks wrote
    pipe = runtime.LocalPipeline(write_tp_package(tmp_path / "one", stages=1, tp=1))
    pipe.load_checkpoint(root / "resumed")
    for name, value in pipe.state_dict().items():
        assert torch.equal(value, want[name]), name


@pytest.mark.multiproc
@pytest.mark.parametrize("mesh", [dict(tp=2), dict(tp=1, dp=2), dict(tp=1, dp=2, zero=1)],
                         ids=["pp2-tp2", "pp2-dp2", "pp2-dp2-zero1"])
def test_resume_on_another_mesh_on_two_ranks(mesh: dict[str, int], tmp_path: Path) -> None:
    """A checkpoint LocalPipeline wrote on 2 stages, resumed on 2 ranks of tp 2 (sharded reads,
    a qkv in 3 blocks) or of dp 2 (both replicas write the same boxes: DCP keeps one), or of
    dp 2 under ZeRO-1 (each replica reads and writes the states of the parameters it owns),
    and read back in one process."""
    root = tmp_path / "ckpts"
    first = write_tp_package(tmp_path / "pp2", stages=2, tp=1)
    pipe = runtime.LocalPipeline(first)
    mf = package.load_model_file(pipe.manifest, first)
    torch.manual_seed(0)
    pipe.load_state_dict(mf.build_model().state_dict())
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.01, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    losses = []
    for step in range(6):
        if step == 3:
            pipe.save_checkpoint(root / "step-3", opt, extra={"scheduler": sched.state_dict(), "step": 3})
        opt.zero_grad()
        losses.append(pipe.train_step(mf.example_inputs(), mf.example_target()))
        opt.step()
        sched.step()
    other = write_tp_package(tmp_path / "other", stages=1, **mesh)
    resumed = _ok(*_launch(2, "resume", other, root), 2)
    torch.testing.assert_close(resumed["losses"], losses[3:], rtol=RTOL, atol=ATOL)
    final = pipe.state_dict()
    for name, value in resumed["state_dict"].items():  # type: ignore[attr-defined]
        torch.testing.assert_close(value, final[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
    back = runtime.LocalPipeline(first)
    back.load_checkpoint(root / "resumed")
    for name, value in back.state_dict().items():
        assert torch.equal(value, resumed["state_dict"][name]), name  # type: ignore[index]


@pytest.mark.multiproc
def test_init_weights_on_two_tensor_parallel_ranks(tmp_path: Path) -> None:
    """Each rank initialises its own shards: together, runtime.init_weights on the unsplit model."""
    pkg = write_tp_package(tmp_path / "tp2", stages=1, tp=2)
    got = _ok(*_launch(2, "init", pkg, tmp_path / "unused"), 2)["state_dict"]
    mf = package.load_model_file(package.load_manifest(pkg), pkg)
    want = runtime.init_weights(mf.build_model(), seed=5).state_dict()
    assert set(got) == set(want)  # type: ignore[arg-type]
    for name in want:
        assert torch.equal(got[name], want[name]), name  # type: ignore[index]
