"""The search's cap on a rank's compute ([Note: a cap on a rank's compute] in
partitioner/solve/solve.py): given one, the DPs return the plan they return without it, or
refuse, and refuse only where every contiguous plan that fits has a rank computing over it."""

from __future__ import annotations

import itertools
import math
import random
from typing import Sequence

import pytest

from partitioner.errors import BeyondCapError, InfeasiblePlanError
from partitioner.ir import Edge, PartitionProblem
from partitioner.solve.model import rank_costs, stage_costs
from partitioner.solve.policies import mixed_key, solve_policies
from partitioner.solve.solve import objective, solve

from .test_recompute_joint import _chain, _problems
from .test_solve import problem

#: (schedule, virtual stages per rank): the DPs the cap prunes, one stage per rank and zb-v's V
SCHEDULES = [("1f1b", 1), ("zb-h1", 1), ("zb-v", 2), ("gpipe", 1)]
#: caps, as fractions of the uncapped plan's busiest rank's compute
FRACTIONS = (0.5, 0.9, 1.0 - 1e-9, 1.0, 1.0 + 1e-9, 1.1, 2.0)


def _random_problem(seed: int) -> PartitionProblem:
    rng = random.Random(seed)
    schedule, v = SCHEDULES[seed % len(SCHEDULES)]
    ranks = rng.randint(2, 3)
    n = rng.randint(ranks * v + 1, 9)
    edges = [(i, i + 1) for i in range(n - 1)]
    edges += [(i, j) for j in range(2, n) for i in range(j - 1) if rng.random() < 0.15]
    return problem([rng.choice([0.5, 1.0, rng.random()]) for _ in range(n)], edges, ranks * v, schedule=schedule,
                   virtual_stages=v, acts=tuple(rng.randint(0, 50) for _ in range(n)), microbatches=rng.randint(1, 6),
                   memory_limit_bytes=rng.choice([None, 400, 700]), comm_alpha_s=rng.choice([0.0, 0.05, 0.4]),
                   comm_beta_s_per_byte=rng.choice([0.0, 2e-3]), bytes={i: rng.randint(0, 100) for i in range(n)},
                   params=tuple((f"w{i}",) for i in range(n)), param_size={f"w{i}": rng.randint(1, 30) for i in range(n)})


def _busiest(p: PartitionProblem, plan: Sequence[int]) -> float:
    """The most compute of any rank of `plan`."""
    return max(r.compute_s for r in rank_costs(p, plan))


def _contiguous(p: PartitionProblem) -> list[tuple[int, ...]]:
    """Every contiguous plan of `p` that fits its memory (a finite objective)."""
    n, S = p.num_blocks, p.stages
    plans = []
    for cuts in itertools.combinations(range(1, n), S - 1):
        bounds = (0, *cuts, n)
        plan = tuple(k for k in range(S) for _ in range(bounds[k], bounds[k + 1]))
        if math.isfinite(objective(p, plan)):
            plans.append(plan)
    return plans


@pytest.mark.parametrize("seed", range(40))
def test_a_capped_dp_returns_the_same_plan_or_refuses_only_where_every_plan_computes_over_it(seed: int) -> None:
    p = _random_problem(seed)
    try:
        uncapped: tuple[int, ...] | None = solve(p, time_limit_s=0.0, explain=False)[0]
    except InfeasiblePlanError:
        uncapped = None
    fits = _contiguous(p)
    reference = _busiest(p, uncapped) if uncapped is not None else sum(p.block_time_s) / p.ranks
    least = min((_busiest(p, plan) for plan in fits), default=math.inf)  # no plan that fits computes less
    for cap in (f * reference for f in FRACTIONS):
        try:
            capped = solve(p, time_limit_s=0.0, explain=False, cap_s=cap)[0]
        except BeyondCapError:
            assert least > cap, (cap, least)  # every plan that fits has a rank over the cap
            assert uncapped is None or _busiest(p, uncapped) > cap
            continue
        assert capped == uncapped, (cap, capped, uncapped)
    if uncapped is not None:  # the cap at the plan's own busiest rank, and just under: kept, then refused
        assert solve(p, time_limit_s=0.0, explain=False, cap_s=_busiest(p, uncapped))[0] == uncapped
        free = p.comm_alpha_s == p.comm_beta_s_per_byte == 0  # else a DP allows the most messages over it
        if least == _busiest(p, uncapped) and free:
            with pytest.raises(BeyondCapError):
                solve(p, time_limit_s=0.0, explain=False, cap_s=least * (1 - 1e-6))


def test_a_capped_v_dp_prunes_and_returns_the_plan() -> None:
    """zb-v on 12 equal blocks and 3 ranks: a cap at the even split's rank keeps its plan, one
    just under it refuses (every plan has a rank of 4 blocks at least)."""
    p = problem([1.0] * 12, [(i, i + 1) for i in range(11)], 6, schedule="zb-v", virtual_stages=2, comm_alpha_s=0.1)
    plan, _ = solve(p, time_limit_s=0.0, explain=False)
    assert _busiest(p, plan) == pytest.approx(4.0)
    assert solve(p, time_limit_s=0.0, explain=False, cap_s=4.0)[0] == plan
    with pytest.raises(BeyondCapError):
        solve(p, time_limit_s=0.0, explain=False, cap_s=3.99)


def test_an_optimum_over_the_cap_by_its_messages_alone_is_still_found() -> None:
    """One stage per rank: the plan's slowest stage is over the cap by its messages, but its
    compute is within it: the DP leaves out only what exceeds the cap plus the most
    messages a run is charged."""
    p = problem([1.0] * 8, [(i, i + 1) for i in range(7)], 4, comm_alpha_s=0.5)
    plan, _ = solve(p, time_limit_s=0.0, explain=False)
    busiest = _busiest(p, plan)
    assert objective(p, plan) > busiest
    assert solve(p, time_limit_s=0.0, explain=False, cap_s=busiest)[0] == plan


@pytest.mark.parametrize("limit", [None, 7250, 9000])
def test_the_joint_dp_of_split_and_policies_takes_the_cap_alike(limit: int | None) -> None:
    problems = _problems(_chain(16, kept=500), [Edge(i, i + 1, f"v{i}", 10) for i in range(15)], 4, 8, limit,
                         comm_alpha_s=0.05)
    plan, policies, _ = solve_policies(problems)
    busiest = max(stage_costs(problems[i], plan)[k].compute_s for k, i in enumerate(policies))  # recomputing too
    assert solve_policies(problems, busiest)[:2] == (plan, policies)
    assert mixed_key(problems, plan)[0] > busiest  # the cap binds below the slowest stage's time
    with pytest.raises(BeyondCapError):
        solve_policies(problems, 16 / 4 * (1 - 1e-6))  # under the mean rank: no plan
