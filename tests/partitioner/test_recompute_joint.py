"""The split and each stage's recomputation policy chosen together (`--recompute auto`,
[Note: split and recomputation chosen together]): faster than one policy for all lowered
per rank after, on a chain of equal blocks under 1F1B, by the cost model and by the
simulator; optimal against brute force over every split and every mix of policies."""

from __future__ import annotations

import itertools
import math
import random
from typing import Sequence

import pytest

from partitioner.errors import InfeasiblePlanError
from partitioner.ir import BlockCost, Edge, PartitionProblem
from partitioner.predict.simulate import simulate
from partitioner.solve.coarsen import build_problem
from partitioner.solve.model import stage_costs
from partitioner.solve.policies import choose_policies, mixed_key, solve_policies
from partitioner.solve.solve import solve

POLICIES = (None, "selective", "full")
FORWARD = 1 / 3  # of each block's time: what full recomputation runs again


def _chain(n: int, *, kept: int, activations: int = 1000) -> list[BlockCost]:
    """`n` equal blocks: time 1, a third of it forward, a tenth of a block redone by selective."""
    return [BlockCost(f"b{i}", (f"n{i}",), time_s=1.0, param_bytes=0, activation_bytes=activations,
                      forward_s=FORWARD, kept_bytes=kept, recomputed_s=0.1) for i in range(n)]


def _problems(blocks: Sequence[BlockCost], edges: Sequence[Edge], stages: int, microbatches: int, limit: int | None,
              schedule: str = "1f1b", **extra: float) -> list[PartitionProblem]:
    """One problem per policy of `POLICIES`, the same blocks, stages and limit."""
    return [build_problem(blocks, edges, stages, microbatches, schedule=schedule, memory_limit_bytes=limit,
                          recompute=r, optimizer_factor=0, **extra) for r in POLICIES]


def _uniform_then_lowered(problems: list[PartitionProblem]) -> tuple[tuple[int, ...], tuple[int | None, ...]]:
    """The split of the first policy under which a plan fits, every stage lowered to the
    cheapest policy up to it that fits: what `auto` did before choosing them together."""
    for level, problem in enumerate(problems):
        try:
            assignment, _ = solve(problem, time_limit_s=0.0, explain=False)
        except InfeasiblePlanError:
            continue
        return assignment, choose_policies(problems[:level + 1], assignment)
    raise AssertionError("no policy fits")


def _step_s(problems: list[PartitionProblem], assignment: tuple[int, ...], policies: Sequence[int | None]) -> float:
    """The simulated 1F1B step, each stage's backward carrying what its policy runs again."""
    first = problems[0]
    forward = [FORWARD * assignment.count(k) for k in range(first.stages)]
    total = [stage_costs(problems[i], assignment)[k].time_s for k, i in enumerate(policies) if i is not None]
    return simulate(forward, [t - f for t, f in zip(total, forward)], {}, first.schedule, first.stages,
                    first.microbatches).step_time_s


def test_a_chain_of_equal_blocks_gets_a_faster_split_with_a_policy_per_stage() -> None:
    """16 equal blocks, 4 stages of 1F1B, 8 microbatches: stage k holds 4 - k in flight.
    Nothing fits without recomputation; selective on every stage fits, but only with the
    last stage (1 in flight, lowered to none) taking 7 blocks.  Chosen together: full on
    the first two, selective on the third, none on the last, 3/4/4/5 blocks."""
    problems = _problems(_chain(16, kept=500), [Edge(i, i + 1, f"v{i}", 10) for i in range(15)], 4, 8, 7250)
    with pytest.raises(InfeasiblePlanError):
        solve(problems[0], time_limit_s=0.0, explain=False)
    old, old_policies = _uniform_then_lowered(problems)
    assignment, policies, report = solve_policies(problems)
    assert [POLICIES[i] for i in policies] == ["full", "full", "selective", None]
    assert [assignment.count(k) for k in range(4)] == [3, 4, 4, 5]
    assert report.status == "OPTIMAL" and report.objective_s == pytest.approx(4 * (1 + FORWARD))
    assert [POLICIES[i] for i in old_policies] == ["selective", "selective", "selective", None]
    assert mixed_key(problems, old)[0] == pytest.approx(7.0)
    for k, i in enumerate(policies):  # each stage within the limit under its own policy and in-flight count
        assert stage_costs(problems[i], assignment)[k].memory_bytes <= 7250
    assert _step_s(problems, assignment, policies) < _step_s(problems, old, old_policies)


def test_a_limit_nothing_binds_keeps_every_activation() -> None:
    problems = _problems(_chain(8, kept=500), [Edge(i, i + 1, f"v{i}", 10) for i in range(7)], 4, 8, None)
    assignment, policies, _ = solve_policies(problems)
    assert policies == (0, 0, 0, 0) and [assignment.count(k) for k in range(4)] == [2, 2, 2, 2]


def test_nothing_fits_under_any_mix() -> None:
    problems = _problems(_chain(8, kept=500), [Edge(i, i + 1, f"v{i}", 10) for i in range(7)], 4, 8, 1500)
    with pytest.raises(InfeasiblePlanError, match="under any recomputation policy"):
        solve_policies(problems)


def _random_chain(seed: int) -> tuple[list[PartitionProblem], int]:
    """A chain of 5 to 7 random blocks (for odd seeds a value skipping one now and then), 3 stages, a
    schedule of three, messages that cost, and a limit between the leanest and the fullest."""
    rng = random.Random(seed)
    n = rng.randint(5, 7)
    blocks = [BlockCost(f"b{i}", (f"n{i}",), time_s=rng.uniform(0.5, 2.0), param_bytes=rng.randint(0, 300),
                        activation_bytes=(acts := rng.randint(100, 1000)), forward_s=rng.uniform(0.1, 0.6),
                        kept_bytes=rng.randint(0, acts), recomputed_s=rng.uniform(0.0, 0.1)) for i in range(n)]
    edges = [Edge(i, i + 1, f"v{i}", rng.randint(1, 200)) for i in range(n - 1)]
    edges += [Edge(i, i + 2, f"s{i}", rng.randint(1, 200)) for i in range(n - 2) if seed % 2 and rng.random() < 0.3]
    schedule = rng.choice(["1f1b", "gpipe", "zb-h2"])
    loose = _problems(blocks, edges, 3, 4, None, schedule, comm_alpha_s=0.05, comm_beta_s_per_byte=1e-3)
    most = max(c.memory_bytes for c in stage_costs(loose[0], _even(n, 3)))
    return _problems(blocks, edges, 3, 4, rng.randint(most // 4, most), schedule, comm_alpha_s=0.05,
                     comm_beta_s_per_byte=1e-3), n


def _even(n: int, stages: int) -> tuple[int, ...]:
    return tuple(min(i * stages // n, stages - 1) for i in range(n))


def _brute_force(problems: list[PartitionProblem], n: int) -> float:
    """The least slowest stage over every contiguous split (a chain has no others) and
    every policy per stage, each stage within the limit under its policy."""
    stages, limit, best = problems[0].stages, problems[0].memory_limit_bytes, math.inf
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        assignment = tuple(k for k in range(stages) for _ in range(bounds[k + 1] - bounds[k]))
        costs = [stage_costs(p, assignment) for p in problems]
        for mix in itertools.product(range(len(problems)), repeat=stages):
            chosen = [costs[i][k] for k, i in enumerate(mix)]
            if limit is None or all(c.memory_bytes <= limit for c in chosen):
                best = min(best, max(c.time_s for c in chosen))
    return best


@pytest.mark.parametrize("seed", range(30))
def test_the_joint_plan_equals_brute_force(seed: int) -> None:
    """Optimal where the DP's bound is met, always where each value goes to the next block
    only; where a value skips a block the DP charges its message as the least any plan
    pays ([Note: the cost of a boundary]), a bound of the optimum, and says FEASIBLE
    where its plan pays more."""
    problems, n = _random_chain(seed)
    best = _brute_force(problems, n)
    try:
        assignment, policies, report = solve_policies(problems)
    except InfeasiblePlanError:
        assert best == math.inf
        return
    assert report.lower_bound_s <= best * (1 + 1e-9) and report.objective_s >= best * (1 - 1e-9)
    if seed % 2 == 0:
        assert report.status == "OPTIMAL"
    if report.status == "OPTIMAL":
        assert report.objective_s == pytest.approx(best, rel=1e-9)
    assert mixed_key(problems, assignment)[0] == pytest.approx(report.objective_s, rel=1e-9)
    assert len(policies) == problems[0].stages
