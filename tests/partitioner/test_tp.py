"""Tensor parallelism on the compiler side: layouts, rules, the solver against brute force,
Megatron's pattern where it pays, the rewrite into one rank's graph."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx
import torch.nn.functional as F

from partitioner.cost.hardware import load_hardware
from partitioner.trace.passes import propagate, specialize
from partitioner.trace.trace import trace
from partitioner.ir import REPLICATED, Layout, NodeCost
from partitioner.tp import (CopyCost, EdgeCost, ShardingProblem, SplitContext, brute_force, choose, sharding_cost, pose_sharding,
                            shard, split_rule)
from partitioner.tp.shapes import view_map

from ..conftest import FREE_LINKS as FREE, compile_example


# -- layouts and views --------------------------------------------------------------------


def test_layout_local_shape_and_name() -> None:
    assert REPLICATED.local_shape((6, 8, 96), 2) == (6, 8, 96) and str(REPLICATED) == "R"
    assert Layout(2).local_shape((6, 8, 96), 2) == (6, 8, 48) and str(Layout(2)) == "S2"
    assert str(Layout(0, 3)) == "S0x3"


@pytest.mark.parametrize(
    "ins, outs, dim, parts, blocks, want",
    [
        ((6, 8, 32), (6, 8, 4, 8), 2, 2, 1, 2),  # (B, T, C) -> (B, T, heads, hs): the heads
        ((6, 8, 4, 8), (6, 8, 32), 2, 2, 1, 2),  # and back
        ((6, 8, 32), (48, 32), 2, 2, 1, 1),  # flatten the batch: C stays whole-dim
        ((6, 8, 32), (48, 32), 1, 2, 1, None),  # T is inside the flattened dim: not contiguous
        ((6, 8, 32), (48, 32), 0, 2, 1, 0),  # the batch is the outer part of the flattened dim
        ((48, 96), (6, 8, 96), 1, 2, 3, 2),  # a blocked dim passes a pure rename
        ((6, 8, 96), (6, 8, 3, 32), 2, 2, 3, None),  # but not a split of itself
        ((6, 8, 4, 8), (6, 8, 32), 3, 2, 1, None),  # hs is inner
        ((1, 8, 32), (8, 32), 2, 2, 1, 1),  # size-1 dims drop out
    ],
)
def test_view_map(ins: tuple[int, ...], outs: tuple[int, ...], dim: int, parts: int, blocks: int,
                  want: int | None) -> None:
    assert view_map(ins, outs, dim, parts, blocks) == want


# -- the solver ------------------------------------------------------------------------------


def _random_problem(rng: random.Random, n: int) -> ShardingProblem:
    counts = [rng.randint(1, 3) for _ in range(n)]
    costs = tuple(tuple(round(rng.uniform(0, 10), 3) for _ in range(k)) for k in counts)
    edges = []
    for v in range(1, n):
        for u in rng.sample(range(v), min(v, rng.randint(1, 2))):
            matrix = tuple(tuple(0.0 if i == j == 0 else (math.inf if rng.random() < 0.2 else round(rng.uniform(0, 5), 3))
                                 for j in range(counts[v])) for i in range(counts[u]))
            edges.append(EdgeCost(u, v, matrix))
    copies = [CopyCost(u, round(rng.uniform(0, 4), 3), tuple((v, rng.randrange(counts[v])) for v in rng.sample(range(n), 2)))
              for u in rng.sample(range(n), 2)]
    return ShardingProblem(tuple(f"v{i}" for i in range(n)), costs, tuple(edges), tuple(copies))


@pytest.mark.parametrize("seed", range(40))
def test_choose_equals_brute_force_on_random_problems(seed: int) -> None:
    problem = _random_problem(random.Random(seed), random.Random(seed).randint(2, 7))
    choice, report = choose(problem, time_limit_s=5.0)
    _, best = brute_force(problem)
    assert sharding_cost(problem, choice) == pytest.approx(best, rel=1e-5, abs=1e-6)
    assert report.status == "OPTIMAL"
    assert report.objective_s <= report.replicated_s + 1e-12


def _mlp_graph() -> tuple[torch.fx.GraphModule, dict[str, NodeCost]]:
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = torch.nn.Linear(8, 16)
            self.down = torch.nn.Linear(16, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(F.gelu(self.up(x)))

    return _traced(Block())


def _traced(model: torch.nn.Module, rows: int = 4) -> tuple[torch.fx.GraphModule, dict[str, NodeCost]]:
    """`model` on a (rows, 8) input, traced through its modules as the compiler does; a
    linear costs 1 ms forward and 2 ms backward, any other node 1 us."""
    x = torch.randn(rows, 8)
    gm = trace(model, (x,), {}, "fx").gm
    specialize(gm, propagate(gm, [x]))
    scale = {True: 1e-3, False: 1e-6}
    costs = {n.name: NodeCost(n.name, forward_s=scale[n.target is F.linear], backward_s=2 * scale[n.target is F.linear],
                              output_bytes=128)
             for n in gm.graph.nodes if n.op == "call_function"}
    return gm, costs


def test_choose_equals_brute_force_on_a_real_graph() -> None:
    gm, costs = _mlp_graph()
    for hardware in ("a100", FREE):
        posed = pose_sharding(gm, costs, 2, load_hardware(hardware))
        sizes = [len(c) for c in posed.problem.cost_s]
        assert math.prod(sizes) < 200_000
        choice, _ = choose(posed.problem, time_limit_s=5.0)
        _, best = brute_force(posed.problem)
        assert sharding_cost(posed.problem, choice) == pytest.approx(best, rel=1e-6)


def test_expensive_links_keep_everything_whole_and_free_links_split() -> None:
    gm, costs = _mlp_graph()
    slow = json.loads(Path(FREE).read_text()) | {"name": "slow", "intra_node_latency_s": 1.0}
    path = Path(__file__).parent / "_slow.json"
    path.write_text(json.dumps(slow))
    try:
        whole = shard(gm, costs, 2, load_hardware(str(path)))
    finally:
        path.unlink()
    assert whole.rules == {} and whole.params == {}
    split = shard(gm, costs, 2, load_hardware(FREE))
    assert split.rules["linear"] == "linear.column" and split.rules["linear_1"] == "linear.row"


# -- Megatron's pattern, where the cost model says it pays ------------------------------------


def test_a_transformer_block_is_split_as_megatron_splits_it(tmp_path: Path) -> None:
    manifest = compile_example("tests/model_files/gpt_wide.py", tmp_path / "pkg", stages=1, tp=2).manifest
    tensor = manifest.tensor_parallel
    rules = tensor["rules"]
    for layer, (qkv, proj, fc, out) in enumerate([("linear", "linear_1", "linear_2", "linear_3"),
                                                  ("linear_4", "linear_5", "linear_6", "linear_7")]):
        assert rules[qkv] == "linear.columnx3", f"layer {layer}: fused q/k/v split by heads"
        assert rules[proj] == "linear.row", f"layer {layer}: attention output projection"
        assert rules[fc] == "linear.column" and rules[out] == "linear.row", f"layer {layer}: MLP"
    assert sum(r == "attention.heads" for r in rules.values()) == 2
    # forward all_reduces: one per attention, one per MLP, one for the vocabulary-split embedding
    assert tensor["collectives"]["all_reduce"] == 2 * 2 + 1
    # backward all_reduces (tp.copy): before each block's q/k/v and MLP, and the LM head
    assert tensor["collectives"]["copy"] == 2 * 2 + 1
    sharded = tensor["sharded_parameters"]
    assert sharded["h.0.attn.c_attn.weight"] == "S0x3" and sharded["h.0.mlp.c_proj.weight"] == "S1"
    assert "h.0.ln_1.weight" not in sharded and "h.0.mlp.c_proj.bias" not in sharded
    source = (tmp_path / "pkg" / "stage_0.py").read_text()
    assert "h_0_mlp_c_proj_linear_sum = tp.all_reduce(h_0_mlp_c_proj_linear_partial)" in source
    assert "h_0_mlp_c_proj = h_0_mlp_c_proj_linear_sum + self.h_0_mlp_c_proj_bias" in source
    assert "h_0_mlp_c_fc_layer_norm_copy = tp.copy(h_0_ln_2)" in source
    params = {p.source_name: p for p in manifest.stages[0].parameters}
    assert list(params["h.0.attn.c_attn.weight"].shape) == [1536, 1024]
    assert params["h.0.attn.c_attn.weight"].shard.to_dict() == {"dim": 0, "index": "tp", "count": 2, "blocks": 3}
    assert list(manifest.stages[0].ranks) == [0, 1]


def test_a_tiny_model_on_real_links_is_left_whole(tmp_path: Path) -> None:
    """At d=32, an A100's 3 us link latency costs more than the split saves."""
    manifest = compile_example("examples/gpt.py", tmp_path / "pkg", stages=1, tp=2).manifest
    assert manifest.tensor_parallel["rules"] == {}
    assert "tp." not in (tmp_path / "pkg" / "stage_0.py").read_text()


# -- the rewrite -------------------------------------------------------------------------------


def test_the_rewrite_gives_local_shapes_and_costs() -> None:
    gm, costs = _mlp_graph()
    split = shard(gm, costs, 2, load_hardware("a100"))
    shapes = {n.name: tuple(n.meta["tensor_meta"].shape) for n in split.gm.graph.nodes if "tensor_meta" in n.meta}
    assert shapes["linear"] == (4, 8)  # 16 features, half each
    assert shapes["linear_1"] == (4, 8)  # whole again after the all_reduce
    assert split.costs["linear"].forward_s == pytest.approx(costs["linear"].forward_s / 2)
    assert split.params == {"up.weight": Layout(0), "up.bias": Layout(0), "down.weight": Layout(1)}
    assert split.collectives == {"all_reduce": 1}  # the input needs no gradient: no tp.copy before `up`


def test_every_rank_stage_file_shares_one_source_for_every_tp_rank(tmp_path: Path) -> None:
    manifest = compile_example("examples/gpt.py", tmp_path / "pkg", stages=2, tp=2, dp=2, hardware=FREE).manifest
    assert manifest.mesh.to_dict() == {"pp": 2, "tp": 2, "dp": 2}
    assert [list(s.ranks) for s in manifest.stages] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    tied = {p.source_name: p.shard for s in manifest.stages for p in s.parameters}
    assert tied["wte.weight"].count == 2  # the tied embedding / LM head, split the same way in both stages


# -- the registry ------------------------------------------------------------------------------


def custom_scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2.0


torch.fx.wrap("custom_scale")


def test_a_registered_rule_is_used_for_a_users_function() -> None:
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = torch.nn.Linear(8, 16)
            self.down = torch.nn.Linear(16, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(custom_scale(self.up(x)))

    gm, costs = _traced(Net())
    before = shard(gm, costs, 2, load_hardware("a100"))
    assert "custom_scale" not in before.rules  # no rule: replicated, the linears around it gathered

    @split_rule(custom_scale)
    def _elementwise(ctx: SplitContext) -> list:  # type: ignore[type-arg]
        (x,) = ctx.inputs
        last = ctx.ndim() - 1
        return [ctx.strategy("custom_scale.last", Layout(last), {x: Layout(last)})]

    after = shard(gm, costs, 2, load_hardware("a100"))
    assert after.rules["custom_scale"] == "custom_scale.last"
    assert after.rules["linear"] == "linear.column" and after.rules["linear_1"] == "linear.row"
    assert "all_gather" not in after.collectives


def test_brute_force_is_exhaustive() -> None:
    problem = ShardingProblem(("a", "b"), ((1.0, 0.5), (1.0, 0.2)),
                              (EdgeCost(0, 1, ((0.0, 0.4), (0.6, 0.0))),))
    values = {c: sharding_cost(problem, c) for c in itertools.product(range(2), range(2))}
    assert brute_force(problem) == (min(values, key=values.__getitem__), min(values.values()))


# -- partial sums ------------------------------------------------------------------------------


def test_converting_a_partial_sum_costs_an_all_reduce_or_a_reduce_scatter() -> None:
    from partitioner.ir import PARTIAL
    from partitioner.tp.pose import _convert_s, collective_s

    gm, _ = _mlp_graph()
    node = next(n for n in gm.graph.nodes if n.name == "linear_1")  # (4, 8) float32, needs a gradient
    hw = load_hardware("a100")
    whole = 4 * 8 * 4
    assert _convert_s(node, PARTIAL, REPLICATED, 2, hw) == collective_s("all_reduce", whole, 2, hw)
    assert _convert_s(node, PARTIAL, Layout(0), 2, hw) == pytest.approx(
        collective_s("reduce_scatter", whole, 2, hw) + collective_s("all_gather", whole, 2, hw))
    assert collective_s("reduce_scatter", whole, 2, hw) < collective_s("all_reduce", whole, 2, hw)
    assert _convert_s(node, REPLICATED, PARTIAL, 2, hw) == math.inf


class _RowThenTanh(torch.nn.Module):
    def __init__(self, bias: bool, width: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, width)
        self.down = torch.nn.Linear(width, width, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.down(F.gelu(self.up(x))))


@pytest.mark.parametrize("bias, rows, width", [(False, 4, 16), (True, 1024, 1024)],
                         ids=["bias-free (Llama)", "with a bias, added once"])
def test_a_partial_sum_is_reduce_scattered_for_a_split_reader_and_stays_exact(bias: bool, rows: int,
                                                                              width: int) -> None:
    """A row-split linear whose reader is worth splitting (an expensive tanh): its partial
    sum goes straight to shards by reduce_scatter (half an all_reduce).  A bias is added
    once (`tp.first_rank`), which costs its gradient an all_reduce, so that pays only for
    a large output.  Run on two in-process lanes, the result and every gradient equal
    the original's."""
    import threading

    from runtime import tp as collectives

    torch.manual_seed(0)
    model = _RowThenTanh(bias, width)
    gm, costs = _traced(model, rows)
    costs["tanh"] = NodeCost("tanh", forward_s=1e-3, backward_s=1e-3, output_bytes=128)
    split = shard(gm, costs, 2, load_hardware("a100"))
    assert split.rules["linear_1"] == "linear.row_partial"
    assert split.collectives.get("reduce_scatter") == 1 and split.rules["tanh"].startswith("pointwise")
    x = torch.randn(rows, 8)
    want = model(x)
    want.pow(2).sum().backward()
    lanes, results = collectives.Lanes(2, timeout_s=20.0), [None, None]

    def lane(t: int) -> None:
        local = copy.deepcopy(split.gm)
        for target, layout in split.params.items():
            module, name = target.rsplit(".", 1)
            whole = dict(model.named_parameters())[target].detach()
            piece = collectives.local_shard(whole, layout.dim, t, 2, layout.blocks).clone()
            setattr(local.get_submodule(module), name, torch.nn.Parameter(piece))
        with collectives.lane(lanes, t):
            (out,) = local(x)  # the graph returns the output's leaves
            out.pow(2).sum().backward()
        results[t] = (out.detach(), {n: p.grad for n, p in local.named_parameters()})

    threads = [threading.Thread(target=lane, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    grads = dict(model.named_parameters())
    for t, result in enumerate(results):
        assert result is not None, f"lane {t} failed"
        out, got = result
        torch.testing.assert_close(out, want.detach(), rtol=1e-5, atol=1e-6)
        for name, g in got.items():
            layout = split.params.get(name, REPLICATED)
            ref = grads[name].grad
            expected = ref if layout.replicated else collectives.local_shard(ref, layout.dim, t, 2, layout.blocks)
            scale = float(ref.abs().max())  # sums over 1024 rows: rounding is relative to the largest entry
            torch.testing.assert_close(g, expected, rtol=1e-5, atol=1e-6 * max(1.0, scale),
                                       msg=lambda m: f"lane {t} {name}: {m}")


# -- what a rank saves for backward ------------------------------------------------------------


class _SequenceParallel(torch.nn.Module):
    """Megatron's MLP and a residual: a column split, a row split whose partial sum goes
    straight to row shards (reduce_scatter), and an expensive tanh computed on those shards."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.down(F.gelu(self.up(x))) + x)


def _saved_by_lane(split: Any, model: torch.nn.Module, x: torch.Tensor) -> list[int]:
    """Bytes each of 2 in-process lanes keeps for backward after its forward (one count per
    storage, the weights left out), run with the rank's graph and weight shards."""
    import threading

    from runtime import tp as collectives

    lanes, saved = collectives.Lanes(2, timeout_s=20.0), [0, 0]

    def lane(t: int) -> None:
        local = copy.deepcopy(split.gm)
        for target, layout in split.params.items():
            module, name = target.rsplit(".", 1)
            whole = dict(model.named_parameters())[target].detach()
            setattr(local.get_submodule(module), name,
                    torch.nn.Parameter(collectives.local_shard(whole, layout.dim, t, 2, layout.blocks).clone()))
        weights = {p.untyped_storage().data_ptr() for p in local.parameters()}
        found: dict[int, int] = {}

        def pack(v: torch.Tensor) -> torch.Tensor:
            if v.untyped_storage().data_ptr() not in weights:
                found[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
            return v

        with collectives.lane(lanes, t), torch.autograd.graph.saved_tensors_hooks(pack, lambda v: v):
            out = local(x)
        saved[t] = sum(found.values())
        del out

    threads = [threading.Thread(target=lane, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    return saved


def test_a_sequence_parallel_rank_saves_what_its_costs_say() -> None:
    """The memory model's saved bytes of a tp 2 rank (each node's `activation_bytes` in the
    rank's costs, as `partitioner.predict.memory_terms` sums them for a split graph) against
    what autograd keeps on each of two lanes: the row-sharded tanh after the reduce_scatter
    keeps half its output, and the column split keeps the WHOLE input it multiplies (its
    weight gradient reads every row and column of it), not a half."""
    from partitioner.cost.profile import annotate

    torch.manual_seed(0)
    rows, width = 1024, 256
    model, x = _SequenceParallel(width), torch.randn(rows, width)
    gm = trace(model, (x,), {}, "fx").gm
    values = propagate(gm, [x])
    specialize(gm, values)
    costs = annotate(gm, values, load_hardware("a100"), measure=False)
    for name in ("add", "tanh"):  # worth splitting: the partial sum goes to shards
        costs[name] = dataclasses.replace(costs[name], forward_s=1e-3, backward_s=1e-3)
    split = shard(gm, costs, 2, load_hardware("a100"))
    assert split.rules["linear"] == "linear.column" and split.rules["linear_1"] == "linear.row_partial"
    assert split.collectives.get("reduce_scatter") == 1 and split.rules["tanh"].startswith("pointwise")
    predicted = sum(c.activation_bytes for c in split.costs.values())
    assert _saved_by_lane(split, model, x) == [predicted, predicted]
