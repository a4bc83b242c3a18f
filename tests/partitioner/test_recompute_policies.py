"""Recomputation policies in the planner: the op table, what each policy keeps and redoes
in the cost model, the solvers against brute force, `--recompute auto` per rank, the
command line and plan.txt."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from driver.cli import _parser, parse
from driver.options import CompileOptions
from driver.phases import prepare
from partitioner.cost.roofline import stage_memory_bytes
from partitioner.ir import BlockCost
from partitioner.solve.coarsen import build_problem
from partitioner.solve.solve import evaluate, stage_costs
from runtime.recompute import parse_policy, saves

from ..conftest import compile_example
from .test_solve import _random_problem, solve_or_refuse

GPT = "examples/gpt.py"
#: one stage of GPipe: the split is the whole graph, each policy's memory is exact
ONE_STAGE = dict(stages=1, microbatches=4, schedule="gpipe", offload="none")  # recomputation alone binds


@pytest.mark.parametrize("target, kept", [
    (torch.ops.aten.addmm.default, True), (torch.ops.aten.mm.default, True), (F.linear, True),
    (torch.matmul, True), ("matmul", True), (F.scaled_dot_product_attention, True),
    (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, True), (torch.ops.aten.convolution.default, True),
    (F.softmax, False), ("softmax", False), (F.gelu, False), (F.silu, False), (torch.ops.aten.relu_.default, False),
    (F.dropout, False), (torch.ops.aten.add.Tensor, False), (F.layer_norm, False), ("view", False),
])
def test_the_op_table_keeps_matmuls_and_recomputes_the_rest(target: object, kept: bool) -> None:
    assert saves(target) is kept


def test_policies_parse_with_the_old_true_as_full() -> None:
    assert [parse_policy(v) for v in (True, False, None, "none", "full", "selective")] == \
        [None if v in (False, None, "none") else "full" if v is True else v
         for v in (True, False, None, "none", "full", "selective")]
    with pytest.raises(ValueError, match="recompute policy 'some'"):
        parse_policy("some")


def test_selective_memory_and_time_by_hand() -> None:
    # one block: 10 s (4 forward, 1 of it not kept), activations 100, matmul outputs 30
    blocks = [BlockCost("b", ("n",), time_s=10.0, param_bytes=0, activation_bytes=100, forward_s=4.0, kept_bytes=30,
                        recomputed_s=1.0)]
    none, sel, full = (build_problem(blocks, [], 1, 4, schedule="gpipe", recompute=r) for r in (None, "selective", "full"))
    assert (none.block_time_s, sel.block_time_s, full.block_time_s) == ((10.0,), (11.0,), (14.0,))
    assert [c.memory_bytes for p in (none, sel, full) for c in stage_costs(p, (0,))] == [4 * 100, 70 + 4 * 30, 100]
    assert stage_memory_bytes(0, 70, 4, 2, recompute=True, input_bytes=5, kept_bytes=30) == 70 + 4 * (5 + 30)


@pytest.mark.parametrize("seed", range(20))
def test_selective_plans_equal_brute_force(seed: int) -> None:
    """The interval DP's and CP-SAT's memory with kept bytes is stage_costs' (brute force
    evaluates every assignment through stage_costs)."""
    p = _random_problem(seed)
    kept = tuple((i * 37 + seed) % 50 * 1000 for i in range(p.num_blocks))
    p = dataclasses.replace(p, recompute=True, block_kept_bytes=kept)
    if p.memory_limit_bytes is not None:
        p = dataclasses.replace(p, memory_limit_bytes=p.memory_limit_bytes // 2)
    solved = solve_or_refuse(p)
    if solved is None:
        return
    assignment, report, best = solved
    assert report.objective_s == pytest.approx(best, rel=1e-9)
    assert max(evaluate(p, assignment)[1]) <= p.memory_limit_bytes if p.memory_limit_bytes else True


def test_a_gpt_keeps_less_under_each_policy_and_redoes_more(tmp_path: Path) -> None:
    """Predicted activation bytes (memory less weights, gradients and optimizer state): none
    > selective > full; the step the other way round."""
    got = {r: compile_example(GPT, tmp_path / r, recompute=r, **ONE_STAGE) for r in ("none", "selective", "full")}
    stage = {r: c.plan.stages[0] for r, c in got.items()}
    acts = {r: s.memory_bytes - 4 * s.param_bytes for r, s in stage.items()}  # adam: 2 + 2 per weight byte
    assert acts["none"] > acts["selective"] > acts["full"] > 0
    steps = {r: c.manifest.predicted.step_time_s for r, c in got.items()}
    assert steps["none"] < steps["selective"] < steps["full"]
    assert [s.recompute for s in got["selective"].manifest.stages] == ["selective"]


def test_the_blocks_of_a_gpt_keep_their_matmul_outputs(tmp_path: Path) -> None:
    p = prepare(CompileOptions(model=GPT, out=str(tmp_path), analytic=True, hardware="a100", quiet=True, **ONE_STAGE))
    kept, acts = sum(b.kept_bytes for b in p.blocks), sum(b.activation_bytes for b in p.blocks)
    again, forward = sum(b.recomputed_s for b in p.blocks), sum(b.forward_s for b in p.blocks)
    linears = [n for n in p.traced.gm.graph.nodes if n.op == "call_function" and n.target is F.linear]
    assert linears and kept >= sum(p.costs[n.name].output_bytes for n in linears)
    assert 0 < kept < acts and 0 < again < forward


def test_auto_picks_selective_where_the_limit_lies_between_selective_and_none(tmp_path: Path) -> None:
    need = {r: compile_example(GPT, tmp_path / r, recompute=r, **ONE_STAGE).plan.stages[0].memory_bytes
            for r in ("none", "selective")}
    limit = (need["none"] + need["selective"]) // 2
    auto = compile_example(GPT, tmp_path / "auto", recompute="auto", memory=limit, **ONE_STAGE)
    assert [s.recompute for s in auto.manifest.stages] == ["selective"]
    assert auto.plan.stages[0].memory_bytes == need["selective"] <= limit
    roomy = compile_example(GPT, tmp_path / "roomy", recompute="auto", memory=need["none"], **ONE_STAGE)
    assert [s.recompute for s in roomy.manifest.stages] == [None]


def test_auto_recomputes_only_on_the_ranks_where_memory_binds(tmp_path: Path) -> None:
    """1F1B of 8 microbatches: rank 0 holds two in flight, rank 1 one; under a limit that
    only rank 0 misses without recomputation, rank 1 keeps its activations."""
    mesh = dict(stages=2, microbatches=8, schedule="1f1b", offload="none")
    none = compile_example(GPT, tmp_path / "none", recompute="none", **mesh)
    limit = max(none.plan.stages[1].memory_bytes, none.plan.stages[0].memory_bytes * 95 // 100)
    auto = compile_example(GPT, tmp_path / "auto", recompute="auto", memory=limit, **mesh)
    policies = [s.recompute for s in auto.manifest.stages]
    assert policies[0] is not None and policies[1] is None
    assert max(s.memory_bytes for s in auto.manifest.predicted.stages) <= limit
    text = (tmp_path / "auto" / "plan.txt").read_text()
    assert f"recomputation by stage: {policies[0]}, none" in text


@pytest.mark.parametrize("argv, devices, want", [
    ([], None, "none"), (["--recompute"], None, "full"), (["--recompute", "selective"], None, "selective"),
    (["--recompute", "none"], 8, "none"), ([], 8, "auto"), (["--recompute", "auto"], None, "auto"),
])
def test_the_command_line_policy(argv: list[str], devices: int | None, want: str) -> None:
    ns = _parser().parse_args(["compile", "m.py", "--out", "o", *argv])
    assert CompileOptions(model="m.py", out="o", recompute=ns.recompute, devices=devices).recompute_policy == want


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(SystemExit):
        parse(["compile", "m.py", "--out", "o", "--recompute", "some"])


def test_recompute_alone_before_the_model_file_reads_the_file_as_the_model() -> None:
    ns = parse(["compile", "--recompute", "m.py", "--out", "o"])
    assert (ns.model, ns.recompute) == ("m.py", "full")
    ns = parse(["compile", "--recompute", "selective", "m.py", "--out", "o"])
    assert (ns.model, ns.recompute) == ("m.py", "selective")


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_show_lists_the_bytes_each_stage_saves_by_recomputing(tmp_path: Path, policy: str) -> None:
    """`show`'s recompute line gives, per stage, the walked bytes its policy saves against
    keeping every activation: the difference of the stages' predicted memory between the
    two compiles; a package without the figures still shows the policies."""
    from codegen.report import format_bytes, format_plan
    from runtime.manifest import read_manifest

    mesh = dict(stages=2, microbatches=4, schedule="gpipe", offload="none")  # every microbatch held on each stage
    plans = [compile_example(GPT, tmp_path / r, recompute=r, **mesh).plan for r in ("none", policy)]
    assert [s.nodes for s in plans[0].stages] == [s.nodes for s in plans[1].stages]  # one split: the walk's difference
    kept, redone = read_manifest(tmp_path / "none").predicted, read_manifest(tmp_path / policy)
    assert kept is not None and redone.predicted is not None
    saved = [a.memory_bytes - b.memory_bytes for a, b in zip(kept.stages, redone.predicted.stages)]
    assert all(n > 0 for n in saved), saved
    assert redone.predicted.extra["recompute"] == [{"stage": k, "policy": policy, "saved_bytes": n}
                                                   for k, n in enumerate(saved)]
    line = next(x for x in (tmp_path / policy / "plan.txt").read_text().splitlines() if x.startswith("recompute "))
    assert line.endswith(", ".join(f"stage {k} {policy} ({format_bytes(n)} less)" for k, n in enumerate(saved)))
    del redone.predicted.extra["recompute"]  # as a package compiled before the figures were written
    assert f"stage 0 {policy}, stage 1 {policy}" in format_plan(redone)
