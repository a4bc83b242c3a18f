"""The solver where a rank runs several stages (interleaved, zb-v's V): the slowest rank, the
memory of a rank and its messages, against brute force."""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

import pytest

from partitioner.errors import InfeasiblePlanError
from partitioner.ir import PartitionProblem
from partitioner.solve.cpsat import solve_cpsat
from partitioner.solve.solve import objective, rank_costs, solve, stage_costs, violations
from partitioner.solve.vee import vee_memory, vee_plans

from .test_solve import CHAIN, MiB, _lex_brute_force, _rounded_key, brute_force, problem, solve_or_refuse

#: (schedule, virtual stages per rank): zb-v's V, and stages round the ranks (1f1b's placement and memory
#: model, which the registry gives interleaved too)
PLACEMENTS = [("zb-v", 2), ("1f1b", 2), ("1f1b", 3)]


def test_placement_is_the_schedules() -> None:
    assert problem([1] * 6, CHAIN, 6, schedule="zb-v", virtual_stages=2).placement == (0, 1, 2, 2, 1, 0)
    assert problem([1] * 6, CHAIN, 6, virtual_stages=2).placement == (0, 1, 2, 0, 1, 2)
    assert problem([1] * 6, CHAIN, 3).placement == (0, 1, 2)


# -- the cost model, by hand -------------------------------------------------------------


def test_the_turn_of_the_v_sends_nothing() -> None:
    # stages 1 and 2 are rank 1's: their boundary is handed over in memory
    p = problem([1, 1, 1, 1], CHAIN[:3], 4, schedule="zb-v", virtual_stages=2, comm_alpha_s=0.5)
    costs = stage_costs(p, (0, 1, 2, 3))
    assert [c.messages for c in costs] == [2, 2, 2, 2]  # one pair each, forward and backward
    assert [c.time_s for c in costs] == [2.0, 2.0, 2.0, 2.0]
    assert [c.time_s for c in rank_costs(p, (0, 1, 2, 3))] == [4.0, 4.0]
    plain = problem([1, 1, 1, 1], CHAIN[:3], 4, comm_alpha_s=0.5)  # 1F1B: every boundary is a message
    assert [c.time_s for c in stage_costs(plain, (0, 1, 2, 3))] == [2.0, 3.0, 3.0, 2.0]


def test_a_rank_holds_its_stages_memory_and_a_tied_parameter_once() -> None:
    # the V puts the first and last stage on rank 0: the tied embedding is one parameter there
    p = problem([1, 1, 1, 1], CHAIN[:3], 4, schedule="zb-v", virtual_stages=2, acts=(10, 0, 0, 10),
                params=(("wte",), ("w1",), ("w2",), ("wte",)), param_size={"wte": 100, "w1": 1, "w2": 2})
    stages, ranks = stage_costs(p, (0, 1, 2, 3)), rank_costs(p, (0, 1, 2, 3))
    assert [c.memory_bytes for c in stages] == [100 * 4 + 10 * 4, 1 * 4, 2 * 4, 100 * 4 + 10 * 1]
    assert [c.memory_bytes for c in ranks] == [100 * 4 + 10 * 4 + 10 * 1, (1 + 2) * 4]
    assert [c.weight_bytes for c in ranks] == [100, 3]
    interleaved = problem([1, 1, 1, 1], CHAIN[:3], 4, virtual_stages=2, params=p.block_params,
                          param_size={"wte": 100, "w1": 1, "w2": 2})  # ranks 0: 0 and 2, 1: 1 and 3
    assert [c.weight_bytes for c in rank_costs(interleaved, (0, 1, 2, 3))] == [102, 101]


def test_the_memory_limit_bounds_a_rank() -> None:
    # each stage fits 9 alone, but a rank of two does not
    p = problem([1, 1, 1, 1], CHAIN[:3], 4, schedule="zb-v", virtual_stages=2, param_bytes=(2, 2, 2, 2),
                memory_limit_bytes=15)
    assert max(c.memory_bytes for c in stage_costs(p, (0, 1, 2, 3))) == 8
    assert violations(p, (0, 1, 2, 3)) == ["rank 0 needs 16 bytes > 15", "rank 1 needs 16 bytes > 15"]
    with pytest.raises(InfeasiblePlanError, match=r"needs at least 16 B on one rank"):
        solve(p, time_limit_s=5)


def test_the_slowest_rank_is_minimised_not_the_slowest_stage() -> None:
    # 8 equal layers in 4 stages on 2 ranks: 2 per stage, or ranks of 4 however the V is cut
    times = [1.0] * 4 + [3.0] * 4
    p = problem(times, [(i, i + 1) for i in range(7)], 4, schedule="zb-v", virtual_stages=2)
    assignment, report = solve(p, time_limit_s=5)
    assert report.objective_s == pytest.approx(8.0)  # 16 in all: rank 0 takes 1 + 1 + 3 + 3, rank 1 the rest
    assert [c.time_s for c in rank_costs(p, assignment)] == [8.0, 8.0]
    assert report.method == "dp"  # a chain: the V DP's bound is met, no CP-SAT


# -- against brute force -----------------------------------------------------------------


def _random_problem(seed: int, chain: bool) -> PartitionProblem:
    rng = random.Random(seed)
    schedule, v = PLACEMENTS[seed % len(PLACEMENTS)]
    ranks = rng.randint(1, 2) if v == 2 else 1
    n = rng.randint(ranks * v, 6 if ranks * v == 4 else 7)
    edges = [(i, i + 1) for i in range(n - 1)] if chain else []
    edges += [(i, j) for j in range(1, n) for i in range(j) if rng.random() < 0.3 and (i, j) not in edges]
    names = ["p0", "p1", "p2"]
    params = tuple(tuple(sorted(rng.sample(names, rng.randint(0, 2)))) for _ in range(n))
    return problem([rng.random() for _ in range(n)], edges, ranks * v, schedule=schedule, virtual_stages=v,
                   acts=tuple(rng.randint(0, 50) for _ in range(n)), microbatches=rng.randint(1, 4),
                   memory_limit_bytes=rng.choice([None, 300, 500]), comm_alpha_s=rng.choice([0.0, 0.05, 0.3]),
                   comm_beta_s_per_byte=rng.choice([0.0, 1e-3]), bytes={i: rng.randint(0, 100) for i in range(n)},
                   params=params, param_size={"p0": 10, "p1": 20, "p2": 5}, recompute=rng.random() < 0.25)


@pytest.mark.parametrize("chain", [True, False], ids=["chain", "dag"])
@pytest.mark.parametrize("seed", range(24))
def test_random_problems_equal_brute_force(seed: int, chain: bool) -> None:
    """Both steps against every assignment: the slowest rank, then balance and bytes;
    CP-SAT alone (not warm-started) finds the same slowest rank."""
    p = _random_problem(seed, chain)
    solved = solve_or_refuse(p)
    if solved is None:
        return
    assignment, report, best = solved
    assert not violations(p, assignment)
    assert report.objective_s == pytest.approx(best, rel=1e-9)
    assert report.lower_bound_s <= report.objective_s * (1 + 1e-9)
    assert _rounded_key(p, assignment) == _lex_brute_force(p)
    cp = solve_cpsat(p, 5)
    assert cp.assignment is not None and objective(p, cp.assignment) == pytest.approx(best, rel=1e-6)


def _contiguous_brute_force(p: PartitionProblem, key: Any) -> float:
    """The least key over every contiguous plan (each stage a run of the block order)."""
    n, S = p.num_blocks, p.stages
    found = math.inf
    for cuts in itertools.combinations(range(1, n), S - 1):
        bounds = (0, *cuts, n)
        plan = tuple(k for k in range(S) for _ in range(bounds[k], bounds[k + 1]))
        found = min(found, key(plan))
    return found


@pytest.mark.parametrize("ranks, blocks", [(3, (6, 9)), (2, (13, 16))])
@pytest.mark.parametrize("seed", range(12))
def test_the_v_dp_finds_the_best_contiguous_plan(seed: int, ranks: int, blocks: tuple[int, int]) -> None:
    """`vee_plans` on chains without skips (its bound exact there) and `vee_memory`
    anywhere: the least over every contiguous plan of 3 ranks (6 stages), whose runs the
    walk takes band by band, and of 2 ranks on more blocks, whose it takes from whole
    tables (`_Banded.of`)."""
    rng = random.Random(seed)
    n = rng.randint(*blocks)
    p = problem([rng.random() for _ in range(n)], [(i, i + 1) for i in range(n - 1)], 2 * ranks, schedule="zb-v",
                virtual_stages=2, acts=tuple(rng.randint(0, 50) for _ in range(n)),
                comm_alpha_s=rng.choice([0.0, 0.1]), comm_beta_s_per_byte=1e-3,
                params=tuple(("t",) if i in (0, n - 1) else (f"w{i}",) for i in range(n)),
                param_size={"t": 40, **{f"w{i}": rng.randint(1, 30) for i in range(n)}})
    fastest, balanced, bound = vee_plans(p)
    assert fastest is not None and objective(p, fastest) == pytest.approx(bound, rel=1e-9)
    assert balanced is not None and objective(p, balanced) == pytest.approx(bound, rel=1e-9)
    assert bound == pytest.approx(_contiguous_brute_force(p, lambda a: objective(p, a)), rel=1e-9)
    lean = vee_memory(p)
    assert lean is not None
    fullest = lambda a: max(c.memory_bytes for c in rank_costs(p, a))  # noqa: E731
    assert fullest(lean) == pytest.approx(_contiguous_brute_force(p, fullest), abs=p.stages)


def test_interleaved_paces_the_slowest_stage_not_the_ranks_sums() -> None:
    # stages 0 and 2 on rank 0, 1 and 3 on rank 1: interleaved 1F1B runs one virtual stage
    # after another, so the slowest stage is minimised ([Note: what the schedule runs])
    p = problem([4, 1, 1, 1, 1, 4], CHAIN, 4, virtual_stages=2)
    assignment, report = solve(p, time_limit_s=5)
    assert report.objective_s == pytest.approx(brute_force(p)) == pytest.approx(4.0)
    assert report.method == "dp" and report.gap < 1e-9  # a chain: the DP's bound is met, no CP-SAT
    assert max(c.time_s for c in stage_costs(p, assignment)) == 4.0


def test_a_rank_over_memory_names_its_stages() -> None:
    p = problem([1, 1, 1, 1], CHAIN[:3], 2, schedule="zb-v", virtual_stages=2, param_bytes=(MiB,) * 4,
                memory_limit_bytes=9 * MiB)
    with pytest.raises(InfeasiblePlanError, match=r"on rank 0 \(stages 0 and 1: weights 4\.0 MiB, gradients 4\.0 MiB, "
                                                  r"optimizer 8\.0 MiB, activations 0 B for 2 and 1 microbatches"):
        solve(p, time_limit_s=5)
