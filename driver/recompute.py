"""`--recompute auto`: the planner chooses none, selective or full recomputation per rank.

[Note: recomputation chosen per rank]
    The problem is solved with every stage on the cheapest policy that lets some plan fit
    in memory, trying none, then selective, then full (each costs more time than the one
    before: `LEVELS`).  Then, with that split fixed, each pipeline rank whose stages fit
    with a cheaper policy takes the cheapest that fits, all its stages alike (a rank
    holds them all, [Note: activations in flight] in runtime/schedule/registry.py), so
    recomputation stays only where memory binds.  Every rank's memory is the cost
    model's under its own policy, never over --memory; the step is never slower than
    the uniform plan's, since no stage's time grows.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from partitioner.errors import InfeasiblePlanError
from partitioner.ir import Plan, SolverReport
from partitioner.solve.model import rank_costs
from partitioner.solve.problem import make_plan, pose

from .memory import stage_parts
from .options import AUTO
from .prepared import Prepared

__all__ = ["LEVELS", "cheapest_per_rank", "planned", "recompute_block", "solve_cheapest_policy", "with_policy"]

#: the policies in order of the time they add ([Note: recomputation chosen per rank])
LEVELS: tuple[str | None, ...] = (None, "selective", "full")

_Solve = Callable[[Prepared], tuple[Prepared, tuple[int, ...], SolverReport]]


def with_policy(p: Prepared, policy: str | None) -> Prepared:
    """`p` posed again with every stage on `policy` (same trace, costs and blocks)."""
    assert p.coarse is not None
    mesh = dataclasses.replace(p.mesh, recompute=policy)
    return dataclasses.replace(p, mesh=mesh, problem=pose(p.coarse, mesh, p.hardware))


def solve_cheapest_policy(p: Prepared, solve_one: _Solve) -> tuple[Prepared, tuple[int, ...], SolverReport]:
    """The first of `LEVELS` under which `solve_one` finds a plan that fits, its Prepared
    and plan; the last policy's error where none fits."""
    for policy in LEVELS:
        try:
            return solve_one(with_policy(p, policy))
        except InfeasiblePlanError:
            if policy == LEVELS[-1]:
                raise
            p.say(f"--recompute auto: no plan fits with recomputation {policy or 'none'}; trying the next")
    raise AssertionError("unreachable: the last level raises")


def cheapest_per_rank(p: Prepared, plan: Plan, assignment: tuple[int, ...]) -> Plan:
    """`plan` (the stage of each block of `p`: `assignment`) with each rank on the cheapest
    of `LEVELS` that fits its memory, up to the plan's own, under `--recompute auto`
    ([Note: recomputation chosen per rank]); else `plan` itself."""
    level = LEVELS.index(plan.policy(0))
    if level == 0 or p.opts.recompute_policy != AUTO:
        return plan
    limit = p.problem.memory_limit_bytes
    plans = [make_plan(with_policy(p, policy).problem, p.blocks, assignment, plan.report, p.mesh)
             for policy in LEVELS[:level]] + [plan]
    fits = [[limit is None or r.memory_bytes <= limit for r in rank_costs(with_policy(p, policy).problem, assignment)]
            for policy in LEVELS[:level]]
    stages = list(plan.stages)
    for r in range(plan.pp):
        chosen = next((i for i in range(level) if fits[i][r]), level)
        for k in (k for k in range(plan.num_stages) if plan.rank_of(k) == r):
            stages[k] = plans[chosen].stages[k]
    mixed = dataclasses.replace(plan, stages=tuple(stages), recompute=False)
    return dataclasses.replace(mixed, recompute=all(mixed.policy(k) == "full" for k in range(plan.num_stages)))



def planned(p: Prepared, assignment: tuple[int, ...], report: SolverReport | None) -> Plan:
    """The Plan of `assignment` (a stage per block of `p`), each rank on the cheapest policy
    that fits under `--recompute auto` (`cheapest_per_rank`)."""
    return cheapest_per_rank(p, make_plan(p.problem, p.blocks, assignment, report, p.mesh), assignment)


def recompute_block(p: Prepared, plan: Plan) -> dict[str, Any]:
    """The manifest's `predicted.recompute`: per stage that recomputes, its policy and the
    device bytes that saves against keeping every activation, the difference of the two
    plans' walked parts ([Note: the memory walk] in partitioner/predict/memory.py), each
    without offloading (nothing when no stage recomputes)."""
    if not plan.recomputes:
        return {}
    kept = [dataclasses.replace(s, recompute=None) for s in plan.stages]
    keep_all = dataclasses.replace(plan, stages=tuple(kept), recompute=False, offload=())
    saved = [a - b for a, b in zip(stage_parts(p, keep_all), stage_parts(p, dataclasses.replace(plan, offload=())))]
    return {"recompute": [{"stage": k, "policy": plan.policy(k), "saved_bytes": saved[k]}
                          for k in range(plan.num_stages) if plan.policy(k)]}
