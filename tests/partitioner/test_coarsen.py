"""Coarsening: contiguous blocks that keep non-tensor values whole, follow modules, and
end with the output; and the problem they pose."""

from __future__ import annotations

import itertools
import random
from typing import Any, Sequence

import pytest

from partitioner.solve.coarsen import build_problem, coarsen, param_sizes
from partitioner.ir import BlockCost, GraphNode, NodeCost
from partitioner.solve.solve import objective, solve


def node(name: str, inputs: Sequence[str] = (), module: str = "", t: float = 1.0, params: Sequence[str] = (),
         param_bytes: int = 0, out: int = 100, **extra: Any) -> GraphNode:
    cost = NodeCost(name, forward_s=t / 3, backward_s=2 * t / 3, param_bytes=param_bytes, activation_bytes=10,
                    output_bytes=out)
    return GraphNode(name, tuple(inputs), cost, module, tuple(params), **extra)


def gpt(layers: int = 4) -> list[GraphNode]:
    """wte/wpe, layers of ln -> qkv -> split (a tuple) -> 3 getitems -> attn -> proj -> add
    -> mlp -> add, ln_f, a head tied to wte, the output."""
    nodes = [node("emb", [], "wte", 0.5, ["wte.weight"], 1000), node("pos", [], "wpe", 0.1, ["wpe.weight"], 50),
             node("x", ["emb", "pos"], "", 0.01), node("drop", ["x"], "drop", 0.0)]
    x = "drop"
    for i in range(layers):
        h = f"h.{i}"
        nodes += [
            node(f"ln1_{i}", [x], f"{h}.ln_1", 0.05),
            node(f"qkv_{i}", [f"ln1_{i}"], f"{h}.attn.c_attn", 1.0, [f"{h}.c_attn.weight", f"{h}.c_attn.bias"], 300),
            node(f"split_{i}", [f"qkv_{i}"], f"{h}.attn", 0.0, tensor_output=False),
            *[node(f"g{j}_{i}", [f"split_{i}"], f"{h}.attn", 0.0) for j in range(3)],
            node(f"sdpa_{i}", [f"g0_{i}", f"g1_{i}", f"g2_{i}"], f"{h}.attn", 0.5),
            node(f"proj_{i}", [f"sdpa_{i}"], f"{h}.attn.c_proj", 0.3, [f"{h}.c_proj.weight"], 100),
            node(f"res1_{i}", [x, f"proj_{i}"], h, 0.01),
            node(f"fc_{i}", [f"res1_{i}"], f"{h}.mlp.c_fc", 1.2, [f"{h}.c_fc.weight"], 400),
            node(f"fc2_{i}", [f"fc_{i}"], f"{h}.mlp.c_proj", 1.2, [f"{h}.mlp.weight"], 400),
            node(f"res2_{i}", [f"res1_{i}", f"fc2_{i}"], h, 0.01),
        ]
        x = f"res2_{i}"
    nodes += [node("lnf", [x], "ln_f", 0.05), node("head", ["lnf"], "lm_head", 2.0, ["wte.weight"], 1000),
              node("output", ["head"], "", 0.0, is_output=True)]
    return nodes


def block_of(blocks: Sequence[BlockCost]) -> dict[str, int]:
    return {n: b for b, block in enumerate(blocks) for n in block.nodes}


@pytest.mark.parametrize("max_blocks", [1, 2, 3, 5, 6, 8, 12, 20, 40, 200])
def test_blocks_are_contiguous_and_keep_their_invariants(max_blocks: int) -> None:
    nodes = gpt()
    blocks, edges = coarsen(nodes, max_blocks)
    where = block_of(blocks)
    assert len(blocks) <= max_blocks
    assert [n for b in blocks for n in b.nodes] == [n.name for n in nodes]  # contiguous, in order
    assert where["output"] == len(blocks) - 1
    for n in nodes:
        if not n.tensor_output:
            assert all(where[c.name] == where[n.name] for c in nodes if n.name in c.inputs)
    assert all(e.src < e.dst for e in edges)
    assert len({(e.src, e.dst, e.value) for e in edges}) == len(edges)
    assert sum(b.time_s for b in blocks) == pytest.approx(sum(n.cost.time_s for n in nodes))


@pytest.mark.parametrize("max_blocks, expected", [
    (6, ["wte", "h.0", "h.1", "h.2", "h.3", "lm_head"]),  # cheap nodes joined their neighbours
    (3, ["wte", "h", "lm_head"]),
    (12, ["wte", "wpe", "h.0.attn", "h.0.mlp", "h.1.attn", "h.1.mlp", "h.2.attn", "h.2.mlp", "h.3.attn",
          "h.3.mlp.c_fc", "h.3.mlp.c_proj", "lm_head"]),  # room left: the heaviest module splits
])
def test_blocks_follow_module_boundaries(max_blocks: int, expected: list[str]) -> None:
    blocks, _ = coarsen(gpt(), max_blocks)
    assert [b.name for b in blocks] == expected


@pytest.mark.parametrize("max_blocks", [6, 9, 13, 20])
def test_no_block_straddles_two_layers(max_blocks: int) -> None:
    blocks, _ = coarsen(gpt(), max_blocks)
    layer = {n.name: n.module.split(".")[1] for n in gpt() if n.module.startswith("h.")}
    for b in blocks:
        assert len({layer[n] for n in b.nodes if n in layer}) <= 1, b


def test_cheap_nodes_join_a_neighbour() -> None:
    blocks, _ = coarsen(gpt(), 200)
    assert all(b.time_s > 0 for b in blocks)
    assert block_of(blocks)["output"] == block_of(blocks)["head"]


def test_output_goes_last_even_if_listed_early() -> None:
    nodes = [node("a"), node("out", ["a"], is_output=True), node("b", ["a"]), node("c", ["b"])]
    blocks, _ = coarsen(nodes, 3)
    assert blocks[-1].nodes[-1] == "out"
    assert [n for b in blocks for n in b.nodes] == ["a", "b", "c", "out"]


def test_flat_graph_splits_evenly() -> None:
    nodes = [node(f"n{i}", [f"n{i - 1}"] if i else []) for i in range(100)]
    blocks, edges = coarsen(nodes, 10)
    assert [len(b.nodes) for b in blocks] == [10] * 10
    assert [(e.src, e.dst, e.value) for e in edges] == [(b, b + 1, f"n{10 * b + 9}") for b in range(9)]


def test_non_tensor_chains_stay_whole() -> None:
    nodes = [node("a"), node("t", ["a"], tensor_output=False), node("u", ["t"], tensor_output=False),
             node("b", ["a"]), node("c", ["u"]), node("d", ["c"])]
    for max_blocks in range(1, 7):
        where = block_of(coarsen(nodes, max_blocks)[0])
        assert where["t"] == where["u"] == where["c"]


def test_params_count_once_per_block_and_tied_ones_solve_as_a_union() -> None:
    nodes = gpt(2)
    blocks, edges = coarsen(nodes, 6)
    wte = [b for b in blocks if "wte.weight" in b.params]
    assert len(wte) == 2 and wte[0] is blocks[0] and wte[1] is blocks[-1]
    sizes = param_sizes(nodes)
    assert sizes["wte.weight"] == 1000 and sizes["h.0.c_attn.weight"] + sizes["h.0.c_attn.bias"] == 300
    assert all(b.param_bytes == sum(sizes[p] for p in b.params) for b in blocks)
    one = build_problem(blocks, edges, 1, 2, param_bytes=sizes)
    assert dict(one.param_bytes_by_name) == {p: sizes[p] for b in blocks for p in b.params}
    _, report = solve(one)
    assert report.objective_s == pytest.approx(sum(b.time_s for b in blocks))


def test_param_sizes_solve_one_unknown_at_a_time() -> None:
    nodes = [node("lin", [], params=["w", "b"], param_bytes=110), node("again", ["lin"], params=["w"], param_bytes=100),
             node("pair", ["again"], params=["p", "q"], param_bytes=7)]
    assert param_sizes(nodes) == {"w": 100, "b": 10, "p": 3, "q": 4}
    assert param_sizes(nodes, {"p": 5})["q"] == 2


def test_nodes_out_of_order_are_rejected() -> None:
    with pytest.raises(ValueError, match="topological order"):
        coarsen([node("a", ["b"]), node("b")], 2)


@pytest.mark.parametrize("stages", [2, 3])
def test_coarsened_problem_solves_to_the_brute_force_optimum(stages: int) -> None:
    nodes = gpt(2)
    blocks, edges = coarsen(nodes, 7)
    p = build_problem(blocks, edges, stages, 4, param_bytes=param_sizes(nodes), comm_alpha_s=0.05,
                      comm_beta_s_per_byte=1e-4, memory_limit_bytes=9500)
    best = min(objective(p, a) for a in itertools.product(range(stages), repeat=p.num_blocks))
    _, report = solve(p, time_limit_s=5)
    assert report.objective_s == pytest.approx(best, rel=1e-9)


# -- [Note: a mutated buffer lives on one stage] -----------------------------------------------


def counted_gpt() -> list[GraphNode]:
    """gpt(4) with a counter buffer as export traces `self.steps += 1; x = x * self.steps`:
    its `add_` first, a scale of layer 0's output by it, and its `copy_` just before the
    output; layer 1 reads the scaled value."""
    nodes = gpt()
    nodes.insert(0, node("add_", [], "", 0.01, mutated=("steps",)))
    at = next(i for i, n in enumerate(nodes) if n.name == "res2_0") + 1
    nodes.insert(at, node("scaled", ["res2_0", "add_"], "", 0.01, mutated=("steps",)))
    nodes = [n if n.name != "ln1_1" else node("ln1_1", ["scaled"], "h.1.ln_1", 0.05) for n in nodes]
    nodes = [n if n.name != "res1_1" else node("res1_1", ["scaled", "proj_1"], "h.1", 0.01) for n in nodes]
    nodes.insert(len(nodes) - 1, node("copy_", ["add_"], "", 0.01, mutated=("steps",)))
    return nodes


@pytest.mark.parametrize("max_blocks", [2, 3, 5, 8, 20, 200])
def test_a_mutated_buffers_nodes_share_a_block_of_their_own(max_blocks: int) -> None:
    blocks, edges = coarsen(counted_gpt(), max_blocks)
    where = block_of(blocks)
    assert where["add_"] == where["scaled"] == where["copy_"]
    assert all(e.src < e.dst for e in edges)
    if max_blocks >= 8:  # layer 0 before the counter's block, layers 1-3 after: the rest still splits
        assert where["res2_0"] <= where["add_"] < where["ln1_1"] and where["add_"] > 0
    if max_blocks == 200:
        assert set(blocks[where["add_"]].nodes) <= {"add_", "scaled", "copy_", "res2_0", "fc2_0", "ln1_1", "res1_1"}


def _closure(nodes: Sequence[GraphNode]) -> dict[str, set[str]]:
    """Every node's ancestors."""
    up: dict[str, set[str]] = {}
    for n in nodes:
        up[n.name] = set(n.inputs).union(*(up[i] for i in n.inputs))
    return up


@pytest.mark.parametrize("seed", range(40))
def test_a_mutated_buffers_block_holds_what_no_order_can_leave_out(seed: int) -> None:
    """Random DAGs, nodes touching one or two buffers: each buffer's nodes share a block;
    with every atom a block (no fusing) and one buffer, that block is its nodes and exactly
    the nodes that one of them feeds and that feed one of them, which every topological
    order puts between them."""
    rng = random.Random(seed)
    n = rng.randint(4, 12)
    names = [f"n{i}" for i in range(n)]
    touch = [tuple(b for b in ("a", "b") if rng.random() < 0.2) for _ in range(n)]
    nodes = [node(names[j], [names[i] for i in range(j) if rng.random() < 0.3], t=rng.random() + 0.1,
                  mutated=touch[j]) for j in range(n)]
    nodes.append(node("output", [names[-1]], is_output=True))
    blocks, edges = coarsen(nodes, 200, cheap_fraction=0.0)
    where, up = block_of(blocks), _closure(nodes)
    assert all(where[i] <= where[x.name] for x in nodes for i in x.inputs)
    groups = [{x.name for x in nodes if b in x.mutated} for b in ("a", "b")]
    for members in filter(None, groups):
        assert len({where[m] for m in members}) == 1
    if sum(map(bool, groups)) == 1:  # with two buffers, their blocks may hold each other's nodes
        members = groups[0] or groups[1]
        between = {x.name for x in nodes if up[x.name] & members and any(x.name in up[m] for m in members)}
        assert set(blocks[where[next(iter(members))]].nodes) == members | between
