"""The device timer (partitioner/cost/timer.py): the compile takes every measurement through
it (nodes, the whole graph, stages, the loss), and where the compile runs the model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, TypeVar

import pytest
import torch

from driver import phases
from driver.options import CompileOptions
from partitioner.cost import calibrate
from runtime.manifest import read_manifest
from partitioner.cost.timer import CpuTimer, CudaTimer, DeviceTimer, device_timer

from ..conftest import compile_example

T = TypeVar("T")
SECONDS = 0.125  # what the fake says every call takes (a power of two: sums stay exact)
PEAK = 12345  # and the peak it says every call reaches


@dataclass(frozen=True)
class FakeTimer(DeviceTimer):
    """A timer that runs each call on the CPU and says it took SECONDS and peaked at PEAK
    bytes: a third implementation of the interface, whose numbers show where it was used."""

    counts_memory: ClassVar[bool] = True

    @property
    def key(self) -> str:
        return "fake"  # its numbers must never be cached as the CPU's

    def timed(self, call: Callable[[], T]) -> tuple[float, T]:
        return SECONDS, call()

    def peak_bytes(self, call: Callable[[], Any]) -> int | None:
        call()
        return PEAK


def test_the_timer_of_each_device() -> None:
    cpu, cuda = device_timer("cpu"), device_timer("cuda:1")  # making one touches no device
    assert isinstance(cpu, CpuTimer) and not cpu.is_cuda and not cpu.counts_memory and cpu.key == "cpu"
    assert isinstance(cuda, CudaTimer) and cuda.is_cuda and cuda.counts_memory and cuda.device == torch.device("cuda:1")
    seconds, value = cpu.timed(lambda: 7)
    assert value == 7 and seconds >= 0.0
    ran: list[int] = []
    assert cpu.peak_bytes(lambda: ran.append(1)) is None and ran == [1]  # the CPU keeps no count, but runs it
    assert cpu.median(lambda: ran.append(1), samples=3, warmup=2) >= 0.0 and len(ran) == 6


def test_the_compile_times_nodes_stages_and_the_loss_with_the_devices_timer(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake timer in place of the CPU's: every measured figure of the package is its own.
    The whole graph's calibration makes the nodes' forwards and backwards add up to one
    fake call each, each stage's calibration makes its own do so, and the loss is one call
    each way; every node, the loss and each stage peak at PEAK."""
    monkeypatch.setattr(phases, "device_timer", lambda device: FakeTimer(torch.device(device)))
    compiled = compile_example("examples/mlp.py", tmp_path / "pkg", stages=2, hardware="cpu", analytic=False,
                               reprofile=True, repeats=1)
    manifest = read_manifest(tmp_path / "pkg")
    calibration = manifest.predicted.extra["calibration"]
    loss = 2 * SECONDS  # on the last stage
    assert calibration["measured_compute_s"] == pytest.approx([2 * SECONDS, 2 * SECONDS + loss])  # stages
    assert sum(calibration["model_compute_s"]) == pytest.approx(2 * SECONDS + loss)  # nodes: the whole graph
    assert calibration["measured_peak_bytes"] == [PEAK, PEAK]
    assert {c.peak_bytes for c in compiled.costs.values()} == {PEAK}


def test_peaks_need_a_device_that_counts_them(tmp_path: Path) -> None:
    """On the CPU no stage runs for its peak; with a counting timer each stage runs, and
    the parameters' gradients are left as they were."""
    compiled = compile_example("examples/mlp.py", tmp_path / "pkg", stages=2, hardware="a100")
    p = phases.prepare(CompileOptions(model="examples/mlp.py", out=str(tmp_path / "p"), stages=2, hardware="a100",
                                      analytic=True, quiet=True))
    stage_of = compiled.plan.stage_of()
    assert calibrate.stage_peak_bytes(p.traced.gm, p.values, stage_of, device_timer("cpu")) == [None, None]
    before = {name: t.grad for name, t in p.traced.gm.named_parameters()}
    fake = FakeTimer(torch.device("cpu"))
    assert calibrate.stage_peak_bytes(p.traced.gm, p.values, stage_of, fake) == [PEAK, PEAK]
    assert {name: t.grad for name, t in p.traced.gm.named_parameters()} == before


@pytest.mark.parametrize(("cuda", "options", "want"), [
    (False, dict(hardware="h200"), "cpu"),  # no CUDA: the CPU, as always
    (True, dict(hardware="h200"), "cuda:0"),  # a GPU's profile, measured
    (True, dict(hardware=None), "cuda:0"),  # this machine's profile: its GPU's
    (True, dict(hardware="cpu"), "cpu"),  # the CPU's profile describes the CPU
    (True, dict(hardware="h200", analytic=True), "cpu"),  # nothing measured
    (True, dict(hardware="h200", meta=True), "cpu"),  # nothing run
])
def test_where_the_compile_runs_the_model(monkeypatch: pytest.MonkeyPatch, cuda: bool, options: dict[str, Any],
                                          want: str) -> None:
    """[Note: where the compile runs the model], decided without a GPU: CUDA's presence
    and the current device are faked (nothing is moved)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_a: "NVIDIA H200")
    cpu = dataclasses.replace(phases.load_hardware("a100"), name="cpu")
    monkeypatch.setattr("partitioner.cost.hardware._cpu", lambda: cpu)  # not measured again here
    opts = CompileOptions(model="examples/mlp.py", out="unused", **{"analytic": False, **options})
    assert phases.compile_device(opts) == torch.device(want)


def test_a_cpu_compile_runs_on_the_cpu_with_its_timer(tmp_path: Path) -> None:
    p = phases.prepare(CompileOptions(model="examples/mlp.py", out=str(tmp_path / "p"), stages=2, hardware="cpu",
                                      repeats=1, quiet=True))
    assert isinstance(p.timer, CpuTimer) and p.timer.device == torch.device("cpu")
    assert all(v.device.type == "cpu" for v in p.values.values() if isinstance(v, torch.Tensor))
    assert {c.peak_bytes for c in p.costs.values()} == {None}  # the CPU keeps no count
