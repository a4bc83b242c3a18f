"""Interleaved 1F1B's objective ([Note: what the schedule runs] in partitioner/solve/model.py):
the closed form against the simulator, every virtual stage balanced, and the solver against
brute force over every contiguous split."""

from __future__ import annotations

import itertools
import random

import pytest

from partitioner.ir import PartitionProblem
from partitioner.predict.simulate import simulate
from partitioner.solve.model import interleaved_step_s
from partitioner.solve.solve import objective, plan_key, solve, stage_costs

from .test_solve import problem


def _chain(times: list[float], stages: int, **options: object) -> PartitionProblem:
    return problem(times, [(i, i + 1) for i in range(len(times) - 1)], stages, **options)  # type: ignore[arg-type]


def _simulated(p: PartitionProblem, assignment: tuple[int, ...]) -> float:
    """The step the simulator gives a plan's stage times, a third forward, free links."""
    times = [c.compute_s for c in stage_costs(p, assignment)]
    links = {(k, k + 1): 0.0 for k in range(p.stages - 1)}
    return simulate([t / 3 for t in times], [2 * t / 3 for t in times], links, "interleaved", p.ranks,
                    p.microbatches, p.virtual_stages).step_time_s


@pytest.mark.parametrize("ranks, virtual, microbatches", [(2, 2, 4), (2, 4, 2), (3, 3, 9), (4, 2, 4), (4, 3, 8),
                                                          (8, 2, 16)])
def test_the_closed_form_is_the_simulated_step_of_equal_stages(ranks: int, virtual: int, microbatches: int) -> None:
    p = _chain([1.0] * (ranks * virtual), ranks * virtual, virtual_stages=virtual, microbatches=microbatches)
    step = _simulated(p, tuple(range(ranks * virtual)))
    assert step == pytest.approx((microbatches * virtual + ranks - 1) * 1.0)
    assert interleaved_step_s(p, 1.0) == pytest.approx(step)


@pytest.mark.parametrize("ranks, virtual", [(2, 2), (2, 3), (4, 2), (4, 3), (3, 4)])
@pytest.mark.parametrize("alpha", [0.0, 0.05])
def test_a_chain_of_equal_blocks_gives_equal_virtual_stages(ranks: int, virtual: int, alpha: float) -> None:
    stages = ranks * virtual
    p = _chain([1.0] * (2 * stages), stages, virtual_stages=virtual, microbatches=2 * ranks, comm_alpha_s=alpha)
    assignment, report = solve(p, time_limit_s=5)
    assert [c.compute_s for c in stage_costs(p, assignment)] == [2.0] * stages
    assert report.method == "dp" and report.gap < 1e-9


def _contiguous_splits(n: int, stages: int) -> list[tuple[int, ...]]:
    """Every split of n blocks into `stages` non-empty runs, as a stage per block."""
    out = []
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        out.append(tuple(k for k in range(stages) for _ in range(bounds[k + 1] - bounds[k])))
    return out


@pytest.mark.parametrize("seed", range(16))
def test_the_interleaved_objective_against_brute_force(seed: int) -> None:
    """On random chains, the solver's slowest virtual stage is the least over every
    contiguous split, messages and memory included; and the simulated step of its plan
    is no slower than the closed form's (M v + p - 1) x that stage."""
    rng = random.Random(seed)
    ranks, virtual = rng.choice([(2, 2), (2, 3), (3, 2)])
    stages = ranks * virtual
    n = rng.randint(stages, stages + 4)
    p = _chain([rng.uniform(0.2, 2.0) for _ in range(n)], stages, virtual_stages=virtual,
               microbatches=ranks * rng.randint(1, 3), comm_alpha_s=rng.choice([0.0, 0.1]),
               comm_beta_s_per_byte=rng.choice([0.0, 1e-3]), bytes={i: rng.randint(0, 100) for i in range(n)},
               acts=tuple(rng.randint(0, 50) for _ in range(n)), memory_limit_bytes=rng.choice([None, 400]))
    best = min(objective(p, a) for a in _contiguous_splits(n, stages))
    if best == float("inf"):
        return
    assignment, report = solve(p, time_limit_s=5)
    assert report.objective_s == pytest.approx(best, rel=1e-9)
    assert max(c.time_s for c in stage_costs(p, assignment)) == pytest.approx(best, rel=1e-9)
    slowest = max(c.compute_s for c in stage_costs(p, assignment))
    assert _simulated(p, assignment) <= interleaved_step_s(p, slowest) * (1 + 1e-9)


@pytest.mark.parametrize("seed", range(24))
def test_stages_near_the_block_count_keep_the_lexicographic_best(seed: int) -> None:
    """Where the stages nearly fill the blocks, each stage's runs lie in a narrow band
    (a block for every stage before and after it), which the DPs take alone: the plan is
    still the least by `plan_key` over every contiguous split (slowest, balance, bytes),
    ties of equal blocks included, one stage per rank or several."""
    rng = random.Random(seed)
    ranks, virtual = rng.choice([(2, 1), (3, 1), (4, 1), (2, 2), (2, 3), (3, 2)])
    stages = ranks * virtual
    n = stages + rng.randint(0, 3)
    p = _chain([float(rng.randint(1, 3)) for _ in range(n)], stages, virtual_stages=virtual,
               microbatches=ranks * rng.randint(1, 3), comm_alpha_s=rng.choice([0.0, 0.5]),
               bytes={i: rng.randint(0, 3) for i in range(n)}, acts=tuple(rng.randint(0, 50) for _ in range(n)),
               memory_limit_bytes=rng.choice([None, 120, 200]))
    keys = [plan_key(p, a) for a in _contiguous_splits(n, stages)]
    best = min((round(k[0], 9), round(k[1], 9), k[2]) for k in keys)
    if best[0] == float("inf"):
        return
    assignment, _ = solve(p, time_limit_s=0.0)
    k = plan_key(p, assignment)
    assert (round(k[0], 9), round(k[1], 9), k[2]) == best
