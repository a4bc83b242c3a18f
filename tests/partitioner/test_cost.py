"""Stage calibration (`cost.calibrate_stages`) and the tied-gradient all-reduce in the prediction."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from partitioner import cost
from partitioner.compiler import CompileOptions, prepare
from partitioner.hardware import load_hardware
from partitioner.predict import tied_allreduce_s
from partitioner.roofline import ring_allreduce_s

from ..conftest import compile_example


def _prepared(tmp_path: Path, model: str) -> Any:
    return prepare(CompileOptions(model=model, out=str(tmp_path / "pkg"), stages=2, hardware="a100", analytic=True,
                                  quiet=True))


def test_a_stage_graph_computes_what_the_stage_computes(tmp_path: Path) -> None:
    """The second stage of a 2-stage GPT, cut out on its own: one placeholder per value it
    reads from the first stage or the batch, and outputs equal to the whole graph's values."""
    compiled = compile_example("examples/gpt.py", tmp_path / "pkg", stages=2, hardware="a100")
    p = _prepared(tmp_path, "examples/gpt.py")
    stage_of = compiled.plan.stage_of()
    names = {n for n, s in stage_of.items() if s == 1}
    sub, values = cost._stage_graph(p.traced.gm, p.values, names)
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    outside = {x.name for n in p.traced.gm.graph.nodes if n.name in names for x in n.all_input_nodes
               if x.name not in names and x.op != "get_attr"}
    assert {n.name for n in placeholders} == outside and outside
    assert {n.name for n in cost.compute_nodes(sub)} == names
    with torch.no_grad():
        got = sub(*[values[n] for n in placeholders])
    by_name = {n.name: n for n in p.traced.gm.graph.nodes}
    outputs = next(n for n in sub.graph.nodes if n.op == "output").args[0]
    assert len(got) == len(outputs) >= 1
    for node, value in zip(outputs, got):
        assert torch.equal(value, p.values[by_name[node.name]]), node.name


def test_each_stage_is_calibrated_on_its_own_after_a_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    compiled = compile_example("examples/mlp.py", tmp_path / "pkg", stages=2, hardware="a100")
    p = _prepared(tmp_path, "examples/mlp.py")
    calls: list[tuple[set[str], float]] = []

    def record(gm: torch.fx.GraphModule, values: Any, costs: Any, repeats: int, wait_s: float = 0.0) -> Any:
        calls.append(({n.name for n in cost.compute_nodes(gm)}, wait_s))
        return costs

    monkeypatch.setattr(cost, "_calibrate", record)
    stage_of = compiled.plan.stage_of()
    cost.calibrate_stages(p.traced.gm, p.values, p.costs, stage_of, 3, 5e-4)
    assert calls == [({n for n, s in stage_of.items() if s == k}, 5e-4) for k in (0, 1)]


def test_measured_stage_calibration_keeps_every_node_and_the_weights(tmp_path: Path) -> None:
    """Run for real (mlp, one thread): every node keeps a non-negative cost, and the
    parameters' .grad are left as they were."""
    p = _prepared(tmp_path, "examples/mlp.py")
    compiled = compile_example("examples/mlp.py", tmp_path / "pkg2", stages=2, hardware="a100")
    before = {name: t.grad for name, t in p.traced.gm.named_parameters()}
    out = cost.calibrate_stages(p.traced.gm, p.values, p.costs, compiled.plan.stage_of(), 2, 1e-4)
    assert set(out) == set(p.costs)
    assert all(c.forward_s >= 0 and c.backward_s >= 0 for c in out.values())
    assert {name: t.grad for name, t in p.traced.gm.named_parameters()} == before


def test_a_tied_parameter_on_two_stages_costs_one_all_reduce(tmp_path: Path) -> None:
    """GPT ties its embedding to its head: on 2 stages its gradient is all-reduced between
    the 2 copies at the end of the step; a 1-stage plan, or a model without ties, pays nothing."""
    hw = load_hardware("a100")
    compiled = compile_example("examples/gpt.py", tmp_path / "two", stages=2, hardware="a100")
    tied = [t["source_name"] for t in compiled.manifest["tied_parameters"]]
    assert tied == ["wte.weight"]
    wte = dict(compiled.traced.gm.named_parameters())
    nbytes = next(t.numel() * t.element_size() for name, t in wte.items() if "wte" in name)
    alpha, beta = hw.ring_link()
    assert tied_allreduce_s(compiled.traced.gm, compiled.plan, hw) == pytest.approx(ring_allreduce_s(nbytes, 2, alpha, beta))
    one = compile_example("examples/gpt.py", tmp_path / "one", stages=1, hardware="a100")
    assert tied_allreduce_s(one.traced.gm, one.plan, hw) == 0.0
    mlp = compile_example("examples/mlp.py", tmp_path / "mlp", stages=2, hardware="a100")
    assert tied_allreduce_s(mlp.traced.gm, mlp.plan, hw) == 0.0


def test_a_forward_and_backward_are_timed_without_the_wait_before_them() -> None:
    """`time_forward_backward` idles before each half but times only the work; the backward
    runs from the outputs that need a gradient, and is 0 where none does."""
    linear = torch.nn.Linear(64, 64)
    x = torch.randn(8, 64)
    calls = []

    def forward() -> Any:
        calls.append(1)
        return linear(x), x.sum()  # the second output needs no gradient

    fwd, bwd = cost.time_forward_backward(forward, samples=3, wait_s=0.02)
    assert len(calls) == 4  # one warm-up
    assert 0 < fwd < 0.02 and 0 < bwd < 0.02
    assert linear.weight.grad is not None  # the backward ran
    _, none = cost.time_forward_backward(lambda: x * 2, samples=2)
    assert none == 0.0


def test_measured_costs_are_taken_on_the_threads_a_rank_computes_on(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Node costs and stage calibration run on RANK_THREADS threads whatever the compiling
    process has (the ranks run OMP_NUM_THREADS=1): timed on more, a stage bound to one core
    for its calibration had its threads take turns on it, at a hundredfold cost."""
    from partitioner import compiler
    from partitioner.hardware import RANK_THREADS

    seen: list[tuple[str, int]] = []

    def spy(name: str, real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            seen.append((name, torch.get_num_threads()))
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(compiler, "annotate", spy("nodes", compiler.annotate))
    monkeypatch.setattr(compiler, "calibrate_stages", spy("stages", compiler.calibrate_stages))
    before = torch.get_num_threads()
    torch.set_num_threads(RANK_THREADS + 1)
    try:
        compile_example("examples/mlp.py", tmp_path / "pkg", stages=2, hardware="cpu", analytic=False,
                        reprofile=True, repeats=1)
        assert torch.get_num_threads() == RANK_THREADS + 1
    finally:
        torch.set_num_threads(before)
    assert seen == [("nodes", RANK_THREADS), ("stages", RANK_THREADS)]
