"""Activation recomputation and mixed precision in the cost model: stage memory and time
by hand, the DP and CP-SAT against brute force, the simulator, the error's advice."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from partitioner.solve.coarsen import build_problem
from partitioner.errors import InfeasiblePlanError
from partitioner.cost.hardware import load_hardware
from partitioner.ir import BlockCost, Edge, optimizer_state_factor
from partitioner.cost.roofline import ring_allreduce_s, stage_memory_bytes
from partitioner.solve.solve import evaluate, solve, stage_costs
from partitioner.tp import collective_s

from ..conftest import compile_example
from .test_solve import CHAIN, DIAMOND, MiB, _random_problem, problem, solve_or_refuse


def test_recompute_keeps_inputs_per_microbatch_and_one_microbatch_of_activations() -> None:
    assert stage_memory_bytes(100, 10, inflight=3, optimizer_factor=2) == 100 * 4 + 10 * 3
    assert stage_memory_bytes(100, 10, inflight=3, optimizer_factor=2, recompute=True, input_bytes=2) == 100 * 4 + 10 + 2 * 3


def test_stage_costs_with_recompute_by_hand() -> None:
    # 0 -> 1 -> 2, v0 100 bytes, v1 30 bytes; stages (0, 1, 1) of 1F1B with 4 microbatches:
    # stage 0 keeps 2 in flight and receives nothing; stage 1 keeps 1 and receives v0 once
    p = problem([1.0, 2.0, 3.0], [(0, 1), (1, 2)], 2, acts=(7, 8, 9), bytes={0: 100, 1: 30}, microbatches=4,
                param_bytes=(10, 20, 30), recompute=True)
    costs = stage_costs(p, (0, 1, 1))
    assert [c.input_bytes for c in costs] == [0, 100]
    assert [c.memory_bytes for c in costs] == [10 * 4 + 7 + 0 * 2, 50 * 4 + 17 + 100 * 1]
    plain = dataclasses.replace(p, recompute=False)
    assert [c.memory_bytes for c in stage_costs(plain, (0, 1, 1))] == [10 * 4 + 7 * 2, 50 * 4 + 17 * 1]


def test_recompute_adds_each_blocks_forward_to_its_time() -> None:
    blocks = [BlockCost(f"b{i}", (f"n{i}",), time_s=3.0 * (i + 1), param_bytes=0, activation_bytes=0,
                        forward_s=1.0 * (i + 1)) for i in range(3)]
    edges = [Edge(0, 1, "n0", 8), Edge(1, 2, "n1", 8)]
    assert build_problem(blocks, edges, 2, 4).block_time_s == (3.0, 6.0, 9.0)
    assert build_problem(blocks, edges, 2, 4, recompute=True).block_time_s == (4.0, 8.0, 12.0)


@pytest.mark.parametrize("seed", range(40))
def test_recompute_plans_equal_brute_force(seed: int) -> None:
    """The interval DP's and CP-SAT's memory with recompute is stage_costs' (brute force
    evaluates every assignment through stage_costs)."""
    p = dataclasses.replace(_random_problem(seed), recompute=True)
    if p.memory_limit_bytes is not None:
        p = dataclasses.replace(p, memory_limit_bytes=p.memory_limit_bytes // 3)
    solved = solve_or_refuse(p)
    if solved is None:
        return
    assignment, report, best = solved
    assert report.objective_s == pytest.approx(best, rel=1e-9)
    assert max(evaluate(p, assignment)[1]) <= p.memory_limit_bytes if p.memory_limit_bytes else True


def test_a_dag_with_recompute_fits_where_it_did_not() -> None:
    # 1 MiB of activations per block, 4 microbatches: without recompute stage 0 of 2 holds
    # 2 in flight, so no split fits 2.5 MiB; with it, one microbatch's and 100-byte inputs
    p = problem([1, 1, 1, 1], DIAMOND, 2, acts=(MiB,) * 4, memory_limit_bytes=5 * MiB // 2, microbatches=4)
    with pytest.raises(InfeasiblePlanError, match=r"recompute activations \(--recompute fits\)"):
        solve(p, time_limit_s=5)
    again = dataclasses.replace(p, recompute=True)
    assignment, _ = solve(again, time_limit_s=5)
    assert max(evaluate(again, assignment)[1]) <= 5 * MiB // 2


def test_the_error_with_recompute_names_its_terms() -> None:
    p = problem([1, 1, 1, 1, 1, 1], CHAIN, 2, acts=(4 * MiB,) * 6, memory_limit_bytes=MiB, recompute=True)
    with pytest.raises(InfeasiblePlanError,
                       match=r"activations 12\.0 MiB of the microbatch recomputed, inputs 100 B for 1 microbatch in flight"):
        solve(p)


def test_mixed_precision_counts_zero_s_sixteen_bytes_per_parameter() -> None:
    assert optimizer_state_factor("adam") == 2
    assert optimizer_state_factor("adam", mixed_precision=True) == 6  # 2 + 2 + 12 bytes per 2-byte weight
    assert optimizer_state_factor("sgd", mixed_precision=True) == 2  # the float32 master copy
    assert stage_memory_bytes(2, 0, 1, optimizer_state_factor("adam", True)) == 16


_GPT = """
import importlib.util
import torch
_spec = importlib.util.spec_from_file_location("_gpt_for_dtype", {path!r})
gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpt)
CONFIG = gpt.GPTConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=128, block_size=16)
loss_fn = gpt.loss_fn
def build_model():
    return gpt.build_model(CONFIG).to(torch.{dtype})
def example_inputs():
    return gpt.example_inputs(CONFIG)
def example_target():
    return gpt.example_target(CONFIG)
"""


def test_a_bfloat16_model_is_planned_with_mixed_precision_state(tmp_path: Path) -> None:
    compiled = {}
    for dtype in ("bfloat16", "float32"):
        model = tmp_path / f"gpt_{dtype}.py"
        model.write_text(_GPT.format(path=str(Path("examples/gpt.py").resolve()), dtype=dtype))
        compiled[dtype] = compile_example(str(model), tmp_path / dtype, stages=2)
    half, full = compiled["bfloat16"], compiled["float32"]
    for plan, factor in ((half.plan, 6), (full.plan, 2)):
        last = plan.stages[1]  # 1F1B: the last stage keeps one microbatch in flight
        # beside weights and activations, the working set and the messages: none of them
        # parameter-sized, so an optimizer factor off by 4 would show here
        extra = last.memory_bytes - last.param_bytes * (2 + factor) - last.activation_bytes
        assert 0 <= extra < 4 * last.param_bytes, (extra, last)
    assert half.plan.stages[1].param_bytes * 2 == full.plan.stages[1].param_bytes


def test_the_simulator_runs_the_forward_again_in_each_backward(tmp_path: Path) -> None:
    plain = compile_example("examples/gpt.py", tmp_path / "plain", stages=2, microbatches=4)
    again = compile_example("examples/gpt.py", tmp_path / "again", stages=2, microbatches=4, recompute=True)
    assert again.manifest.options["recompute"] is True and "recompute" not in plain.manifest.options
    assert all(s.recompute for s in again.manifest.stages)
    assert not any("recompute" in s.to_dict() for s in plain.manifest.stages)
    assert again.plan.recompute and not plain.plan.recompute
    slower = again.manifest.predicted.step_time_s - plain.manifest.predicted.step_time_s
    forward = sum(c.forward_s for c in plain.costs.values())
    assert slower > 0.5 * forward * 4 / 2  # M forwards of each stage more, on the two ranks
    mem_plain = [s.memory_bytes for s in plain.manifest.predicted.stages]
    mem_again = [s.memory_bytes for s in again.manifest.predicted.stages]
    assert mem_again[0] < mem_plain[0]  # stage 0 held 2 microbatches' activations


def test_tp_collectives_beyond_a_node_use_the_inter_node_link() -> None:
    h100 = load_hardware("h100")
    n = 64 * MiB
    inside = collective_s("all_reduce", n, 8, h100)
    assert inside == pytest.approx(ring_allreduce_s(n, 8, h100.p2p_alpha_s, h100.p2p_beta_s_per_byte))
    across = collective_s("all_reduce", n, 16, h100)
    assert across == pytest.approx(ring_allreduce_s(n, 16, h100.inter_node_latency_s, 1 / h100.inter_node_bandwidth))
    assert across > 5 * inside
