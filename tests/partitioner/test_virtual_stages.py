"""Interleaved 1F1B planned end to end ([Note: splits chosen by the simulator] in
driver/phases.py): on a model of the shape of Megatron-LM's 145.6B row (a head a third
of a layer, analytic a100 costs, full recomputation) the plan is no slower than Megatron's
even layers on the same mesh, by the same simulator; --virtual-stages is searched when left
out, fixed when given."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from driver.compile import compile_model
from driver.phases import most_virtual, virtual_counts
from driver.options import CompileOptions
from driver.prepared import Compiled
from partitioner.cost.hardware import load_hardware
from partitioner.cost.nodes import compute_nodes
from partitioner.errors import PlanError
from partitioner.ir import Plan, StagePlan
from partitioner.predict.predict import simulate_plan
from partitioner.trace.passes import node_module

MODEL = str(Path(__file__).resolve().parents[2] / "benchmarks" / "models" / "megatron_gpt.py")
LAYERS, RANKS, MICROBATCHES = 16, 4, 8


def _compile(out: Path, virtual: int | None) -> Compiled:
    return compile_model(CompileOptions(
        model=MODEL, out=str(out), analytic=True, meta=True, hardware="a100", memory=80 << 30, precision="bf16",
        recompute=True, stages=RANKS, microbatches=MICROBATCHES, schedule="interleaved", virtual_stages=virtual,
        quiet=True))


def _even_layers(compiled: Compiled) -> Plan:
    """Megatron-LM's split: LAYERS / (pp v) blocks per virtual stage, the embeddings with
    the first, the final norm and head with the last."""
    plan, per = compiled.plan, LAYERS // compiled.plan.num_stages
    nodes: list[list[str]] = [[] for _ in range(plan.num_stages)]
    stage = 0
    for node in compute_nodes(compiled.traced.gm):
        layer = re.match(r"blocks\.(\d+)", node_module(node))
        stage = int(layer.group(1)) // per if layer else stage
        nodes[stage].append(node.name)
    return Plan(stages=tuple(StagePlan(index=k, nodes=tuple(n), time_s=0.0, compute_s=0.0) for k, n in enumerate(nodes)),
                schedule=plan.schedule, microbatches=plan.microbatches, pp=plan.pp, tp=plan.tp, dp=plan.dp,
                virtual_stages=plan.virtual_stages, recompute=plan.recompute)


def _step(compiled: Compiled, plan: Plan) -> float:
    return simulate_plan(compiled.traced.gm, plan, compiled.costs, load_hardware("a100")).step_time_s


def test_the_plan_is_no_slower_than_even_layers(tmp_path: Path) -> None:
    compiled = _compile(tmp_path / "v2", 2)
    even = _even_layers(compiled)
    assert [len(s.nodes) > 0 for s in even.stages] == [True] * 8
    assert compiled.plan.virtual_stages == 2
    assert _step(compiled, compiled.plan) <= _step(compiled, even) * (1 + 1e-9)
    times = [s.compute_s for s in compiled.plan.stages]
    assert max(times) < 1.1 * sum(times) / len(times)  # every virtual stage balanced, not each rank's sum


def test_virtual_stages_left_out_are_searched(tmp_path: Path) -> None:
    fixed = _compile(tmp_path / "v2", 2)
    searched = _compile(tmp_path / "any", None)
    assert searched.manifest.predicted.step_time_s <= fixed.manifest.predicted.step_time_s
    assert 2 <= searched.plan.virtual_stages <= most_virtual(RANKS, 160)


def test_the_counts_searched() -> None:
    assert virtual_counts(3, 4, 160) == (3,)
    assert virtual_counts(None, 4, 160) == tuple(range(2, 21))
    assert virtual_counts(None, 8, 20) == (2,)


def test_virtual_stages_below_one_are_refused(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match=r"^--virtual-stages 0: a rank runs at least 1 stage"):
        _compile(tmp_path / "x", 0)
