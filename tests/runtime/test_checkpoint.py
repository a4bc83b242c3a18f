"""save_checkpoint / load_checkpoint (runtime/checkpoint/) on LocalPipeline: resume bit for bit
on the same plan, to 1e-5 on another plan (pp, tp, dp, schedule), the original state_dict
through dcp_to_torch_save, and incomplete or corrupt checkpoints refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import runtime
from runtime import package
from runtime.errors import CheckpointError

from .conftest import Tiny, write_package
from .tp_package import write_tp_package

RTOL, ATOL = 1e-5, 1e-6


class Run:
    """A pipeline with an AdamW optimizer and an LR scheduler, trained on one fixed batch."""

    def __init__(self, pkg: Path, initial: dict[str, torch.Tensor] | None = None) -> None:
        self.pipe = runtime.LocalPipeline(pkg)
        self.mf = package.load_model_file(self.pipe.manifest, pkg)
        if initial is not None:
            self.pipe.load_state_dict(initial)
        self.opt = torch.optim.AdamW(self.pipe.parameters(), lr=0.01, weight_decay=0.1)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=2, gamma=0.5)
        self.step = 0

    def train(self, steps: int) -> list[torch.Tensor]:
        losses = []
        for _ in range(steps):
            self.opt.zero_grad()
            losses.append(self.pipe.train_step(self.mf.example_inputs(), self.mf.example_target()))
            self.opt.step()
            self.sched.step()
            self.step += 1
        return losses

    def save(self, path: Path, **kw: Any) -> Path:
        return self.pipe.save_checkpoint(path, self.opt, extra={"scheduler": self.sched.state_dict(), "step": self.step},
                                         **kw)

    def load(self, path: Path) -> None:
        extra = self.pipe.load_checkpoint(path, optimizer=self.opt)
        self.sched.load_state_dict(extra["scheduler"])
        self.step = extra["step"]


def _initial(pkg: Path) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    mf = package.load_model_file(package.load_manifest(pkg), pkg)
    return mf.build_model().state_dict()  # type: ignore[no-any-return]


def test_resume_on_the_same_plan_is_bit_identical(make_tiny: Callable[..., Tiny], tmp_path: Path) -> None:
    pkg = make_tiny(stages=3).dir
    first = Run(pkg, _initial(pkg))
    first.train(3)
    first.save(tmp_path / "ckpt")
    rng, lr = torch.get_rng_state(), first.opt.param_groups[0]["lr"]
    want = first.train(3)
    torch.manual_seed(123)  # the load restores the RNG
    second = Run(pkg)
    second.load(tmp_path / "ckpt")
    assert torch.equal(torch.get_rng_state(), rng)
    assert second.step == 3 and second.opt.param_groups[0]["lr"] == lr
    got = second.train(3)
    assert all(torch.equal(a, b) for a, b in zip(got, want)), (got, want)
    for name, value in first.pipe.state_dict().items():
        assert torch.equal(second.pipe.state_dict()[name], value), name


PLANS = {  # first plan, second plan (same model)
    "pp2-pp3": (dict(stages=2), dict(stages=3)),
    "pp3-pp4-interleaved": (dict(stages=3), dict(stages=4, virtual_stages=2, schedule="interleaved")),
    "dp1-dp2": (dict(stages=2), dict(stages=2, dp=2, microbatches=2)),
    "gpipe-1f1b": (dict(stages=2, schedule="gpipe"), dict(stages=4, schedule="1f1b")),
}


@pytest.mark.parametrize("plans", PLANS.values(), ids=PLANS.keys())
def test_resume_on_another_plan(plans: tuple[dict[str, Any], dict[str, Any]], tmp_path: Path) -> None:
    a, b = (write_package(tmp_path / n, name="pkg", **o) for n, o in zip("ab", plans))
    _resume_across(a, b, tmp_path)


@pytest.mark.parametrize("tps", [(2, 1), (1, 2)], ids=["tp2-tp1", "tp1-tp2"])
def test_resume_across_tensor_parallel_degrees(tps: tuple[int, int], tmp_path: Path) -> None:
    """TpNet: vocabulary-parallel embedding tied to the head, a fused qkv split in 3 blocks."""
    a, b = (write_tp_package(tmp_path / n, stages=2, tp=t) for n, t in zip("ab", tps))
    _resume_across(a, b, tmp_path)


def _resume_across(a: Path, b: Path, tmp_path: Path) -> None:
    first = Run(a, _initial(a))
    first.train(3)
    first.save(tmp_path / "ckpt")
    want = first.train(3)
    second = Run(b)
    second.load(tmp_path / "ckpt")
    got = second.train(3)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    final = first.pipe.state_dict()
    for name, value in second.pipe.state_dict().items():
        torch.testing.assert_close(value, final[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def test_dcp_to_torch_save_gives_the_original_state_dict(tmp_path: Path) -> None:
    pkg = write_tp_package(tmp_path / "a", stages=2, tp=2)
    run = Run(pkg, _initial(pkg))
    run.train(3)
    run.save(tmp_path / "ckpt")
    model = run.mf.build_model()
    model.load_state_dict(_initial(pkg))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(3):
        opt.zero_grad()
        run.mf.loss_fn(model(*run.mf.example_inputs()), run.mf.example_target()).backward()
        opt.step()
        sched.step()
    dcp_to_torch_save(tmp_path / "ckpt", tmp_path / "full.pt")
    got, want = torch.load(tmp_path / "full.pt"), model.state_dict()
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def test_incomplete_and_corrupt_checkpoints_are_refused(make_tiny: Callable[..., Tiny], tmp_path: Path) -> None:
    pkg = make_tiny(stages=2).dir
    run = Run(pkg, _initial(pkg))
    good = run.save(tmp_path / "step-1")
    assert runtime.latest_checkpoint(tmp_path) == good
    # a save that stopped before its marker: the partial folder is refused and skipped
    partial = run.save(tmp_path / "step-2")
    (partial / "COMPLETE.json").unlink()
    with pytest.raises(CheckpointError, match=r"step-2 is incomplete: .*COMPLETE.json is missing, so its save did "
                                              r"not finish .*latest_checkpoint"):
        run.load(partial)
    assert runtime.latest_checkpoint(tmp_path) == good
    # a truncated file is named
    bad = run.save(tmp_path / "step-3")
    shard = next(bad.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])
    with pytest.raises(CheckpointError, match=rf"step-3 is corrupt: .*{shard.name} has 10 bytes but was written with"):
        run.load(bad)
    assert runtime.latest_checkpoint(tmp_path) == good
    # bytes changed in place (same size): the checksum names the file ([Note: checkpoint checksums]);
    # without checksums (a checkpoint saved before them) DCP's reader fails, and the file is named
    bad = run.save(tmp_path / "step-4")
    meta = bad / ".metadata"
    meta.write_bytes(b"x" * meta.stat().st_size)
    with pytest.raises(CheckpointError, match=r"step-4 is corrupt: .*step-4/\.metadata has sha256 .* but was saved"):
        run.load(bad)
    (bad / "CHECKSUMS.json").unlink()
    with pytest.raises(CheckpointError, match=r"step-4 is corrupt: .*step-4/\.metadata cannot be read"):
        run.load(bad)
    run.load(good)


def test_keep_prunes_old_checkpoints(make_tiny: Callable[..., Tiny], tmp_path: Path) -> None:
    pkg = make_tiny(stages=2).dir
    run = Run(pkg, _initial(pkg))
    for step in range(4):
        run.train(1)
        run.save(tmp_path / f"step-{step}", keep=2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step")) == ["step-2", "step-3"]
    assert runtime.latest_checkpoint(tmp_path) == tmp_path / "step-3"


def test_a_checkpoint_of_another_model_is_refused(make_tiny: Callable[..., Tiny], tmp_path: Path) -> None:
    tiny = make_tiny(stages=2).dir
    run = Run(tiny, _initial(tiny))
    run.save(tmp_path / "ckpt")
    other = runtime.LocalPipeline(write_tp_package(tmp_path / "tp", stages=2, tp=2))
    with pytest.raises(CheckpointError, match=r"does not match the package's model \(missing \d+: .*; unexpected "
                                              r"\d+: .*embed.weight"):
        other.load_checkpoint(tmp_path / "ckpt")


def test_latest_checkpoint_of_a_missing_folder_is_none(tmp_path: Path) -> None:
    """An empty folder and one that does not exist yet (a script's first start) hold no
    checkpoint: None, as load_latest; a file in its place is an error."""
    from runtime.errors import CheckpointNotFoundError

    assert runtime.latest_checkpoint(tmp_path) is None
    assert runtime.latest_checkpoint(tmp_path / "nowhere") is None
    assert runtime.load_latest(object(), tmp_path / "nowhere") is None
    assert not (tmp_path / "nowhere").exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(FileNotFoundError, match=r"'.*/file' is a file, not a folder"):
        runtime.latest_checkpoint(tmp_path / "file")
    assert issubclass(CheckpointNotFoundError, CheckpointError)
