"""[Note: checkpoint checksums]: a flipped byte in a file of a 2-stage LocalPipeline
checkpoint is named at load, `load_latest` falls back to the checkpoint before it, and a
checkpoint without CHECKSUMS.json (written before checksums) still loads."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch

import runtime
from runtime.errors import CheckpointCorruptError

from .conftest import Tiny


def _trained(t: Tiny, root: Path) -> tuple[runtime.LocalPipeline, torch.optim.Optimizer, dict[str, torch.Tensor]]:
    """step-000001 and step-000002 under `root`; the weights after step 1."""
    pipe = runtime.LocalPipeline(t.dir)
    pipe.load_state_dict(t.build().state_dict())
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.01)
    first: dict[str, torch.Tensor] = {}
    for step in (1, 2):
        opt.zero_grad()
        pipe.train_step(*t.batch())
        opt.step()
        pipe.save_checkpoint(root / f"step-{step:06d}", opt, extra={"step": step})
        first = first or {k: v.clone() for k, v in pipe.state_dict().items()}
    return pipe, opt, first


def _flip(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))


def _fresh(t: Tiny) -> tuple[runtime.LocalPipeline, torch.optim.Optimizer]:
    pipe = runtime.LocalPipeline(t.dir)
    return pipe, torch.optim.AdamW(pipe.parameters(), lr=0.01)


def test_a_flipped_byte_is_named_and_load_latest_falls_back(make_tiny: Callable[..., Tiny], tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    t = make_tiny(stages=2, microbatches=2)
    _trained(t, tmp_path)
    newest = tmp_path / "step-000002"
    victim = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)  # the model's weights
    _flip(victim)
    pipe, opt = _fresh(t)
    with pytest.raises(CheckpointCorruptError, match=rf"{victim.name} has sha256 .* load the previous checkpoint"):
        pipe.load_checkpoint(newest, optimizer=opt)
    assert runtime.latest_checkpoint(tmp_path) == newest  # unchanged: sizes still match
    path, extra = runtime.load_latest(pipe, tmp_path, optimizer=opt)
    assert path == tmp_path / "step-000001" and extra == {"step": 1}
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{victim} changed after the save" in err, err
    want, _ = _fresh(t)
    want.load_checkpoint(tmp_path / "step-000001")
    for name, value in want.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_every_checkpoint_corrupt_is_an_error(make_tiny: Callable[..., Tiny], tmp_path: Path) -> None:
    t = make_tiny(stages=2, microbatches=2)
    _trained(t, tmp_path)
    for step in (1, 2):
        _flip(tmp_path / f"step-{step:06d}" / "train" / ".metadata")
    with pytest.raises(CheckpointCorruptError, match=r"every complete checkpoint under .* is corrupt \(2, the newest"):
        runtime.load_latest(_fresh(t)[0], tmp_path)
    assert runtime.load_latest(_fresh(t)[0], tmp_path / "step-000001" / "train") is None  # holds none


def test_a_checkpoint_without_checksums_still_loads(make_tiny: Callable[..., Tiny], tmp_path: Path) -> None:
    t = make_tiny(stages=2, microbatches=2)
    pipe, _, _ = _trained(t, tmp_path)
    (tmp_path / "step-000002" / "CHECKSUMS.json").unlink()
    again, opt = _fresh(t)
    assert again.load_checkpoint(tmp_path / "step-000002", optimizer=opt) == {"step": 2}
    for name, value in pipe.state_dict().items():
        torch.testing.assert_close(again.state_dict()[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
