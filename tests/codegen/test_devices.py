"""No device is a constant in generated code ([Note: devices in stage code]), and the fake-GPU
check (tests/fake_gpu.py) catches one that is."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError

import codegen.stage

from ..conftest import ROOT, compile_example
from ..fake_gpu import check_stages_on_fake_gpu

DEVICE_MODEL = '''
import torch


class Positions(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wpe = torch.nn.Embedding(8, 4)
        self.head = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(0, x.shape[1], device=x.device)  # a device taken from a tensor
        scale = torch.full((4,), 0.5)  # a factory call with no device
        return self.head(x + self.wpe(pos) * scale)


def build_model() -> torch.nn.Module:
    return Positions()


def example_inputs() -> tuple[torch.Tensor]:
    return (torch.randn(4, 8, 4),)


def example_target() -> torch.Tensor:
    return torch.randn(4, 8, 4)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)
'''


def test_no_golden_stage_holds_a_device_constant() -> None:
    stages = sorted((ROOT / "tests" / "golden").glob("*/stage_*.py"))
    assert stages
    for path in stages:
        assert "torch.device(" not in path.read_text(), f"{path} writes a device as a constant"


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_device_from_a_tensor_and_a_factory_follow_the_stage(tracer: str, tmp_path: Path) -> None:
    model = tmp_path / "positions.py"
    model.write_text(DEVICE_MODEL)
    compile_example(str(model), tmp_path / "pkg", stages=1, tracer=tracer)
    source = (tmp_path / "pkg" / "stage_0.py").read_text()
    assert "torch.device(" not in source
    assert "device=x.device" in source
    check_stages_on_fake_gpu(tmp_path / "pkg")


def test_the_check_catches_a_device_constant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the rewrite turned off, the trace's CPU device is written as a constant, and
    the check fails on it, as it would have before the rewrite."""
    model = tmp_path / "positions.py"
    model.write_text(DEVICE_MODEL)
    monkeypatch.setattr(codegen.stage, "_device_expr", lambda layout, names: None)
    compile_example(str(model), tmp_path / "pkg", stages=1, tracer="export")
    assert "torch.device('cpu')" in (tmp_path / "pkg" / "stage_0.py").read_text()
    with pytest.raises(FakeTensorDeviceMismatchError, match="cuda:0 and cpu"):
        check_stages_on_fake_gpu(tmp_path / "pkg")
