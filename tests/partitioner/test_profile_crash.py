"""A profiled op that crashes the process does not end the compile: profiling runs in a
forked child, and the node it died on is costed analytically, said in one line
([Note: a profiled op that crashes] in partitioner/cost/guard.py).  A channels_last group
norm, whose weight-only backward crashes torch's CPU kernel, is profiled without a crash,
and a model of them (SegFormer's layout) trains exactly under the zero-bubble schedules
([Note: a weight-only group norm backward] in runtime/split_backward.py).  What could crash
runs in a forked child (tests/forked.py), so that it fails its test, not the session."""

from __future__ import annotations

import dataclasses
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

import runtime
from driver.compile import compile_model
from driver.costs import node_costs
from driver.options import CompileOptions
from partitioner.cost import profile
from partitioner.cost.guard import Crashed, guarded
from partitioner.cost.hardware import load_hardware
from partitioner.cost.measure import rank_threads
from partitioner.trace import model_file
from partitioner.trace.passes import propagate
from runtime.manifest import StageInput, StageOutput, StageSpec
from runtime.stage import StageRunner

from ..conftest import ANY_PLAN_S, train_original, train_pipeline
from ..forked import forked


def _die_on(i: int, crashing: set[int]) -> int:
    if i in crashing:
        os.kill(os.getpid(), signal.SIGSEGV)
    return i * i


def test_guarded_hands_back_each_result_and_crashed_for_the_items_that_crashed() -> None:
    assert list(guarded(6, lambda i: _die_on(i, {1, 2, 5}))) == [0, Crashed("SIGSEGV"), Crashed("SIGSEGV"), 9, 16,
                                                                 Crashed("SIGSEGV")]
    assert list(guarded(2, lambda i: os._exit(3) if i == 0 else i)) == [Crashed("exit status 3"), 1]
    assert list(guarded(0, lambda i: i)) == []


def test_an_exception_in_the_child_is_raised_with_its_traceback() -> None:
    def work(i: int) -> int:
        if i == 1:
            raise ValueError("bad node")
        return i

    with pytest.raises(ValueError, match="bad node") as caught:
        list(guarded(3, work))
    assert any("in work" in note and "forked child" in note for note in getattr(caught.value, "__notes__", []))


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # as the tracer writes it: functions on weights
        x = torch.tanh(torch.nn.functional.linear(x, self.fc1.weight, self.fc1.bias))
        return torch.nn.functional.linear(x, self.fc2.weight, self.fc2.bias)


def _crashing_on(target: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Profiling the nodes that call `target` kills the process, as a buggy kernel would."""
    real = profile._time

    def timed(fn: Any, *args: Any) -> Any:
        if fn is target:
            os.kill(os.getpid(), signal.SIGSEGV)
        return real(fn, *args)

    monkeypatch.setattr(profile, "_time", timed)


def test_a_node_whose_profiling_crashes_is_costed_analytically_and_said(monkeypatch: pytest.MonkeyPatch) -> None:
    gm = torch.fx.symbolic_trace(_Net())
    values = propagate(gm, [torch.randn(8, 16)])
    hardware = load_hardware("cpu")
    _crashing_on(torch.tanh, monkeypatch)
    monkeypatch.setattr(profile, "calibrate_graph", lambda gm, values, costs, *a, **k: costs)  # the costs as found
    said: list[str] = []
    with rank_threads():  # as the compile profiles
        measured = profile.annotate(gm, values, hardware, True, repeats=1, say=said.append)
    assert said == ["warning: profiling node %tanh (tanh) crashed the process (SIGSEGV); its cost is analytic "
                    "(the roofline of cpu)"]
    analytic = profile.annotate(gm, values, hardware, False)
    assert measured["tanh"] == analytic["tanh"] and measured["tanh"].forward_s > 0
    assert measured.keys() == analytic.keys()
    for name in ("linear", "linear_1"):  # measured
        assert measured[name] != analytic[name] and measured[name].flops == analytic[name].flops


def test_the_line_is_said_again_when_the_costs_come_from_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    gm = torch.fx.symbolic_trace(_Net())
    values = propagate(gm, [torch.randn(8, 16)])
    _crashing_on(torch.tanh, monkeypatch)
    opts = CompileOptions(model="net.py", out="pkg", repeats=1, reprofile=True)
    said: list[str] = []
    with rank_threads():
        first = node_costs(gm, values, load_hardware("cpu"), opts, said.append, profile.CPU_TIMER)
        again = node_costs(gm, values, load_hardware("cpu"), dataclasses.replace(opts, reprofile=False), said.append,
                           profile.CPU_TIMER)
    assert first == again
    crashed = [line for line in said if "crashed the process" in line]
    assert len(crashed) == 2 and crashed[0] == crashed[1] and "%tanh" in crashed[0]
    assert any("from the profile cache" in line for line in said)


class _GroupNorm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.GroupNorm(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.conv2d(x.contiguous(memory_format=torch.channels_last), self.conv.weight,
                                       self.conv.bias, padding=1)
        return torch.nn.functional.group_norm(x, 4, self.norm.weight, self.norm.bias)


def test_a_channels_last_group_norm_is_profiled_without_a_crash() -> None:
    """Its W is timed as the runtime runs it, with its input's gradient: no line is said."""

    def body() -> tuple[list[str], dict[str, Any]]:
        gm = torch.fx.symbolic_trace(_GroupNorm())
        values = propagate(gm, [torch.randn(4, 3, 8, 8)])
        norm = next(n for n in gm.graph.nodes if n.name == "group_norm")
        assert values[norm.args[0]].is_contiguous(memory_format=torch.channels_last)
        said: list[str] = []
        costs = profile.annotate(gm, values, load_hardware("cpu"), True, repeats=1, say=said.append)
        return said, costs

    said, costs = forked(body)
    assert said == []
    assert costs["group_norm"].backward_s > 0 and 0 < costs["group_norm"].weight_fraction <= 1


def test_a_guarded_pass_takes_what_the_process_would(monkeypatch: pytest.MonkeyPatch) -> None:
    """The child measures the same nodes with the same FLOPs and bytes as the process itself."""
    gm = torch.fx.symbolic_trace(_Net())
    values = propagate(gm, [torch.randn(8, 16)])
    with rank_threads():
        guarded_costs = profile.annotate(gm, values, load_hardware("cpu"), True, repeats=1)
        monkeypatch.setattr(profile, "can_guard", lambda: False)
        plain = profile.annotate(gm, values, load_hardware("cpu"), True, repeats=1)
    assert guarded_costs.keys() == plain.keys()
    for name, cost in plain.items():
        assert dataclasses.replace(guarded_costs[name], forward_s=0, backward_s=0, weight_fraction=0) == \
            dataclasses.replace(cost, forward_s=0, backward_s=0, weight_fraction=0)


def test_on_several_threads_the_pass_runs_in_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """A child forked from a process whose OpenMP ran several threads would hang."""
    gm = torch.fx.symbolic_trace(_Net())
    values = propagate(gm, [torch.randn(8, 16)])

    def refused(*args: Any) -> Any:
        raise AssertionError("forked")

    monkeypatch.setattr(profile, "guarded", refused)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert profile.annotate(gm, values, load_hardware("cpu"), True, repeats=1).keys() == {"linear", "tanh",
                                                                                               "linear_1"}
    finally:
        torch.set_num_threads(threads)


class _TwoNorms(torch.nn.Module):
    """A group norm on the stage's channels_last input; with `twice`, the same norm again,
    so that its weights are below two frontier nodes and W walks the whole graph
    ([Note: weight-gradient seeds] in runtime/split_backward.py)."""

    def __init__(self, twice: bool) -> None:
        super().__init__()
        self.norm, self.conv, self.twice = torch.nn.GroupNorm(2, 4), torch.nn.Conv2d(4, 4, 1), twice

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        y = self.norm(x)
        return (self.conv(torch.tanh(self.norm(y) if self.twice else y)),)


@pytest.mark.parametrize("twice", [False, True], ids=["seeded", "whole-graph"])
def test_w_of_a_channels_last_group_norm_gives_the_fused_gradients(twice: bool) -> None:
    def body() -> list[tuple[torch.Tensor, torch.Tensor]]:
        torch.manual_seed(0)
        shape = (2, 4, 3, 3)
        spec = StageSpec(index=1, module="s", class_name="S", ranks=(1,),
                         inputs=(StageInput(name="x", shape=shape, dtype="float32", source=0, requires_grad=True),),
                         outputs=(StageOutput(name="y", shape=shape, dtype="float32", to=(2,)),), parameters=())
        fused, split = _TwoNorms(twice), _TwoNorms(twice)
        split.load_state_dict(fused.state_dict())
        x, g = torch.randn(shape).contiguous(memory_format=torch.channels_last), torch.randn(shape)
        runners = [StageRunner(m, spec) for m in (fused, split)]
        for r in runners:
            r.forward(0, [x.clone(memory_format=torch.preserve_format).requires_grad_()], train=True)
        want = runners[0].backward(0, [g])
        got = runners[1].backward_input(0, [g])
        assert (runners[1]._saved[0].seeds is None) == twice
        runners[1].backward_weight(0)
        assert got[0] is not None and want[0] is not None
        return [(got[0], want[0])] + [(q.grad, p.grad) for p, q in zip(fused.parameters(), split.parameters())]

    for got, want in forked(body):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


GROUP_NORMS = "tests/model_files/group_norm_channels_last.py"


def test_a_model_of_channels_last_group_norms_compiles_measured_and_trains_exactly(tmp_path: Path) -> None:
    """Measured costs (nothing said of a crash), then zero-bubble training against the original."""
    steps, lr = 3, 0.1

    def body() -> dict[str, tuple[list[float], dict[str, torch.Tensor]]]:
        said: list[str] = []
        compile_model(CompileOptions(model=GROUP_NORMS, out=str(tmp_path / "pkg"), hardware="cpu", repeats=1,
                                     stages=2, microbatches=2, schedule="zb-h1", time_limit=ANY_PLAN_S), said.append)
        assert any(line.startswith("costs: profiling") for line in said)
        assert not [line for line in said if "crashed" in line]
        mf, trained = model_file.load(GROUP_NORMS), {}
        for schedule in ("zb-h1", "zb-h2"):
            pipe = runtime.LocalPipeline(tmp_path / "pkg", schedule=schedule)
            pipe.load_state_dict(mf.build(0).state_dict())
            trained[schedule] = train_pipeline(pipe, GROUP_NORMS, steps, lr), pipe.state_dict()
        return trained

    want_losses, want = train_original(GROUP_NORMS, steps, lr)
    for schedule, (losses, state) in forked(body).items():
        torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-6, msg=lambda m: f"{schedule}: {m}")
        assert state.keys() == want.keys()
        for name, value in state.items():
            torch.testing.assert_close(value, want[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{schedule}, {name}: {m}")
