"""The chain DP (`partitioner/tp/chain.py`) against brute force and the plain CP-SAT model:
the same objective on random problems and on real graphs, one table per distinct layer."""

from __future__ import annotations

import math
import random

import pytest
import torch

from partitioner.trace import model_file
from driver.options import CompileOptions
from driver.phases import prepare
from partitioner.cost.hardware import load_hardware
from partitioner.tp import CopyCost, EdgeCost, ShardingProblem, brute_force, choose, sharding_cost, pose_sharding
from partitioner.tp import chain

from ..conftest import FREE_LINKS as FREE
from .test_tp import _mlp_graph, _random_problem


def _layered_problem(rng: random.Random, layers: int) -> ShardingProblem:
    """`layers` copies of one random 4-variable layer, each reading the last one's output
    (the residual), plus a 'tied' variable read by the first and the last layer."""
    sizes = [rng.randint(2, 3) for _ in range(4)]
    unary = [tuple(round(rng.uniform(0, 5), 2) for _ in range(k)) for k in sizes]
    inner = [(0, 1), (0, 2), (1, 3), (2, 3)]
    mats = {e: tuple(tuple(0.0 if i == j == 0 else (math.inf if rng.random() < 0.15 else round(rng.uniform(0, 3), 2))
                           for j in range(sizes[e[1]])) for i in range(sizes[e[0]])) for e in inner}
    link = tuple(tuple(0.0 if i == j == 0 else round(rng.uniform(0, 3), 2) for j in range(sizes[0]))
                 for i in range(sizes[3]))
    costs, edges, copies = [], [], []
    for layer in range(layers):
        base = 4 * layer
        costs += unary
        edges += [EdgeCost(base + a, base + b, m) for (a, b), m in mats.items()]
        if layer:
            edges.append(EdgeCost(base - 1, base, link))
        copies.append(CopyCost(base, 1.5, ((base + 1, sizes[1] - 1), (base + 2, 1))))
    tied = len(costs)
    costs.append((0.0, 0.5, 0.7))
    tie = tuple(tuple(0.0 if i == 0 or j == 0 else round(rng.uniform(0, 2), 2) for j in range(sizes[0]))
                for i in range(3))
    edges += [EdgeCost(tied, 0, tie), EdgeCost(tied, 4 * (layers - 1), tie)]
    return ShardingProblem(tuple(f"v{i}" for i in range(len(costs))), tuple(costs), tuple(edges), tuple(copies))


@pytest.mark.parametrize("seed", range(60))
def test_chain_equals_brute_force_on_random_problems(seed: int) -> None:
    rng = random.Random(seed)
    problem = _random_problem(rng, rng.randint(2, 8))
    found = chain.solve_chain(problem)
    assert found is not None
    _, best = brute_force(problem)
    assert sharding_cost(problem, found) == pytest.approx(best, rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_chain_is_within_the_cpsat_bounds_on_layered_problems(seed: int) -> None:
    """CP-SAT's plan is no better than the chain's, and its proved bound no higher (it
    proves optimality only on some of these within its limit: the chain always does)."""
    problem = _layered_problem(random.Random(seed), layers=6)
    chosen, report = choose(problem)
    plain, plain_report = choose(problem, method="cpsat", time_limit_s=2.0)
    assert report.method == "chain" and report.status == "OPTIMAL"
    assert report.lower_bound_s == pytest.approx(report.objective_s)
    got, cpsat = sharding_cost(problem, chosen), sharding_cost(problem, plain)
    assert got <= cpsat * (1 + 1e-6)
    assert plain_report.lower_bound_s <= got * (1 + 1e-6)
    if plain_report.status == "OPTIMAL":
        assert got == pytest.approx(cpsat, rel=1e-6)


def test_chain_equals_brute_force_on_small_layered_problems() -> None:
    for seed in range(6):
        problem = _layered_problem(random.Random(100 + seed), layers=2)
        found = chain.solve_chain(problem)
        assert found is not None
        assert sharding_cost(problem, found) == pytest.approx(brute_force(problem)[1], rel=1e-9)


@pytest.mark.parametrize("model, tp, hardware", [
    ("examples/gpt.py", 2, "a100"),
    ("examples/gpt.py", 4, FREE),
    ("tests/model_files/gpt_wide.py", 2, "a100"),
    ("tests/model_files/gpt_wide.py", 4, "h100"),
    ("examples/bert.py", 2, FREE),
])
def test_chain_equals_cpsat_on_real_graphs(model: str, tp: int, hardware: str) -> None:
    p = prepare(CompileOptions(model=model, out="unused", stages=1, tp=1, analytic=True, hardware=hardware, quiet=True))
    posed = pose_sharding(p.traced.gm, p.costs, tp, load_hardware(hardware))
    chosen, report = choose(posed.problem)
    plain, plain_report = choose(posed.problem, method="cpsat", time_limit_s=20.0)
    assert report.method == "chain"
    assert plain_report.status == "OPTIMAL"
    assert sharding_cost(posed.problem, chosen) == pytest.approx(sharding_cost(posed.problem, plain), rel=1e-6)


def test_the_mlp_block_equals_brute_force() -> None:
    gm, costs = _mlp_graph()
    for hardware in ("a100", FREE):
        problem = pose_sharding(gm, costs, 2, load_hardware(hardware)).problem
        chosen, report = choose(problem)
        assert report.method == "chain"
        assert sharding_cost(problem, chosen) == pytest.approx(brute_force(problem)[1], rel=1e-9)


def test_identical_layers_share_one_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """gpt48's 48 blocks make about 100 segments but only a few distinct tables."""
    p = prepare(CompileOptions(model="examples/gpt48.py", out="unused", stages=1, tp=1, analytic=True,
                               hardware=FREE, quiet=True))
    problem = pose_sharding(p.traced.gm, p.costs, 2, load_hardware(FREE)).problem
    tables, segments = [], []
    real_table, real_segments = chain._table, chain._segments
    monkeypatch.setattr(chain, "_table", lambda *a, **k: tables.append(1) or real_table(*a, **k))
    monkeypatch.setattr(chain, "_segments", lambda *a, **k: segments.append(s := real_segments(*a, **k)) or s)
    found = chain.solve_chain(problem)
    assert found is not None
    cut = len(segments[0][0])
    assert cut >= 2 * 48, "a segment per residual add"
    assert len(tables) <= 12, f"{len(tables)} tables for {cut} segments"
    plain, report = choose(problem, method="cpsat", time_limit_s=30.0)
    assert report.status == "OPTIMAL"
    # CP-SAT's integer objective rounds each cost to 1e-7 of the replicated total, so it
    # cannot see the tie-breaks below that; the exact DP may come out a hair lower
    assert sharding_cost(problem, found) == pytest.approx(sharding_cost(problem, plain), rel=1e-5)
    assert sharding_cost(problem, found) <= sharding_cost(problem, plain) * (1 + 1e-9)


def test_the_tied_embedding_is_a_global_variable() -> None:
    p = prepare(CompileOptions(model="examples/gpt.py", out="unused", stages=1, tp=1, analytic=True, hardware=FREE,
                               quiet=True))
    posed = pose_sharding(p.traced.gm, p.costs, 2, load_hardware(FREE))
    sizes = [len(c) for c in posed.problem.cost_s]
    base = chain._reduce(posed.problem, {v: 0 for v, n in enumerate(sizes) if n == 1})
    found = chain._globals(base, chain._order(base), sizes)
    assert found is not None and [posed.variables[v] for v in found] == ["wte.weight"]


def test_a_problem_too_wide_for_the_chain_goes_to_cpsat() -> None:
    rng = random.Random(7)
    n = 14  # every variable interacts with every other: the frontier holds them all
    costs = tuple(tuple(round(rng.uniform(0, 3), 2) for _ in range(3)) for _ in range(n))
    edges = tuple(EdgeCost(u, v, tuple(tuple(0.0 if i == j == 0 else round(rng.uniform(0, 2), 2) for j in range(3))
                                       for i in range(3)))
                  for v in range(n) for u in range(v))
    problem = ShardingProblem(tuple(f"v{i}" for i in range(n)), costs, edges)
    assert chain.solve_chain(problem, max_states=100) is None
    assert chain.solve_chain(problem) is None  # 3^13 live assignments at the last cut
    _, report = choose(problem, time_limit_s=5.0)
    assert report.method == "cpsat"


def test_unknown_method_is_refused() -> None:
    gm, costs = _mlp_graph()
    problem = pose_sharding(gm, costs, 2, load_hardware(FREE)).problem
    with pytest.raises(ValueError, match="unknown method 'ilp'"):
        choose(problem, method="ilp")


def test_the_gpt3_example_is_175b_bfloat16_parameters_on_the_meta_device() -> None:
    mf = model_file.load("examples/gpt3_175b.py")
    with torch.device("meta"):
        model = mf.build(0)
    params = list(model.parameters())
    assert 174e9 < sum(p.numel() for p in params) < 176e9
    assert {p.dtype for p in params} == {torch.bfloat16}
    assert model.wte.weight.shape == (51200, 12288) and 51200 % (128 * 8) == 0
    args, _ = mf.example_inputs()
    assert tuple(args[0].shape) == (1536, 2048)
