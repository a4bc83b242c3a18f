"""The prepared device check runs end to end on the CPU, its CUDA rows marked as not run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check

from .conftest import compile_example


@pytest.mark.slow
def test_the_device_check_runs_on_the_cpu(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                          tmp_path: Path) -> None:
    monkeypatch.setattr("benchmarks.common.RESULTS", tmp_path)
    assert gpu_check.main(["--quick", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "| a compile | gpt 2 stages, profiled on cpu | ok |" in printed  # stages calibrated, no peaks
    assert "| b equivalence | gpt 2 stages 1f1b fp32 | ok |" in printed
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    statuses = {(r["check"], r["status"]) for r in record["rows"]}
    assert ("c mfu", "not run") in statuses and ("e nccl", "not run") in statuses
    assert not any(s == "FAIL" for _, s in statuses)


@pytest.mark.parametrize("engine", ["partitioner", pytest.param("pipelining", marks=pytest.mark.slow)])
def test_the_distributed_row_trains_like_the_original_on_the_cpu(tmp_path: Path, engine: str) -> None:
    """Row e's two spawned ranks, on gloo here (on two GPUs they meet over NCCL, their
    messages on the communication stream): losses and weights as the original's, on both engines."""
    compile_example("examples/gpt.py", tmp_path / "pkg", stages=2)
    error = gpu_check._distributed_error(tmp_path / "pkg", "examples/gpt.py", tmp_path, torch.device("cpu"), engine)
    assert error <= 1e-5


def test_the_offload_row_steps_like_the_plain_one_on_the_cpu() -> None:
    """Row f's offloaded GPipe step (benchmarks/gpu_offload.py) on the CPU: the same input
    gradients as the plain step, every activation having gone through the host copy."""
    from benchmarks.gpu_offload import Block, offloaded_step
    from runtime.offload import Offloader

    torch.manual_seed(0)
    block = Block(32, 4)
    grads = []
    for offloader in (None, Offloader(1.0)):
        inputs = [torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(i), requires_grad=True) for i in range(3)]
        offloaded_step(block, inputs, offloader)()
        grads.append([x.grad for x in inputs])
        assert offloader is None or offloader.moved_bytes > 0
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
