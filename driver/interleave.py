"""Interleaved 1F1B's split and its stages per rank, chosen by the step simulator.

[Note: splits chosen by the simulator]
    The solver minimises interleaved 1F1B's slowest virtual stage, whose closed form,
    (M v + p - 1) x that stage, is exact only where the stages are equal ([Note: what the
    schedule runs] in partitioner/solve/model.py).  So the driver simulates a few
    candidate splits and keeps the fastest: the solver's plan and the split of the compute
    into even prefix sums (`even_split`: Megatron-LM's even layers, on a chain of equal
    layers), each where it fits; a tie goes to the solver's.  With --virtual-stages left
    out, every count v from 2 to `most_virtual` is posed, solved and simulated alike, the
    layers per virtual stage a consequence of the split (no count needs to divide them):
    v = 2 as a given count is, the others by the interval DP alone (CP-SAT on pp x v stages
    takes its whole time limit), until one does not fit the memory.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

from partitioner.errors import InfeasiblePlanError, PlanError
from partitioner.ir import SolverReport
from partitioner.predict.predict import simulate_plan
from partitioner.solve.problem import make_plan, pose
from partitioner.solve.solve import even_split, objective, solve

from .prepared import Prepared

__all__ = ["MAX_VIRTUAL", "choose_split", "most_virtual", "solve_interleaved", "virtual_counts"]

#: the most stages per rank searched (Megatron-LM's production recipes run 5 to 20)
MAX_VIRTUAL = 20
#: a candidate replaces the best found only when faster by more than this (float sums)
_TIE = 1e-9

Solved = tuple[Prepared, tuple[int, ...], SolverReport]


def most_virtual(pp: int, blocks: int) -> int:
    """The most stages per rank worth a try: a block per stage at least, MAX_VIRTUAL at most."""
    return max(2, min(MAX_VIRTUAL, blocks // pp))


def virtual_counts(given: int | None, pp: int, blocks: int) -> tuple[int, ...]:
    """The stages per rank to try: the count given (--virtual-stages), else 2 to `most_virtual`."""
    return (given,) if given is not None else tuple(range(2, most_virtual(pp, blocks) + 1))


def solve_interleaved(p: Prepared, solve_one: Callable[[Prepared], tuple[tuple[int, ...], SolverReport]]) -> Solved:
    """The fastest simulated plan over the stages per rank to try: the first count solved
    by `solve_one` (CP-SAT where it serves, the errors that explain), the rest by the DP
    alone, up to the first that does not fit, since what a rank holds in flight grows with
    its count ([Note: splits chosen by the simulator])."""
    counts = virtual_counts(p.opts.virtual_stages, p.mesh.pp, p.problem.num_blocks)
    q = p if counts[0] == p.mesh.virtual_stages else _repose(p, counts[0])
    assignment, report = solve_one(q)
    best = (*choose_split(q, assignment, report), q)
    tried = [f"v={counts[0]} {best[0] * 1e3:.3f} ms"]
    for v in counts[1:]:
        q = _repose(p, v)
        try:
            assignment, report = solve(q.problem, time_limit_s=0.0, explain=False)
        except InfeasiblePlanError:
            break
        except PlanError:
            continue
        found = (*choose_split(q, assignment, report), q)
        tried.append(f"v={v} {found[0] * 1e3:.3f} ms")
        if found[0] < best[0] * (1 - _TIE):
            best = found
    if len(tried) > 1:
        p.say(f"interleaved: {best[3].mesh.virtual_stages} stages per rank, the fastest simulated ({', '.join(tried)})")
    return best[3], best[1], best[2]


def choose_split(p: Prepared, assignment: tuple[int, ...], report: SolverReport
                 ) -> tuple[float, tuple[int, ...], SolverReport]:
    """The simulated step of the fastest candidate split of `p.problem`, that split, and the
    solver's report with its objective ([Note: splits chosen by the simulator])."""
    best_step, best = _simulated(p, assignment, report), assignment
    even = even_split(p.problem)
    if even != assignment and math.isfinite(objective(p.problem, even)):
        step = _simulated(p, even, report)
        if step < best_step * (1 - _TIE):
            best_step, best = step, even
    if best is not assignment:
        report = dataclasses.replace(report, objective_s=objective(p.problem, best), method=report.method + "+even")
    return best_step, best, report


def _simulated(p: Prepared, assignment: tuple[int, ...], report: SolverReport) -> float:
    """The step the simulator predicts for `assignment` (what `predict` reports)."""
    plan = make_plan(p.problem, p.blocks, assignment, report, p.mesh)
    return simulate_plan(p.traced.gm, plan, p.costs, p.hardware, p.loss).step_time_s


def _repose(p: Prepared, virtual: int) -> Prepared:
    """`p` posed again with `virtual` stages per rank (same trace, costs and blocks)."""
    assert p.coarse is not None
    mesh = dataclasses.replace(p.mesh, virtual_stages=virtual)
    return dataclasses.replace(p, opts=dataclasses.replace(p.opts, virtual_stages=virtual), mesh=mesh,
                               problem=pose(p.coarse, mesh, p.hardware))
