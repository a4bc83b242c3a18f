"""`--recompute auto`: the planner chooses none, selective or full recomputation per stage.

[Note: recomputation chosen per rank]
    The problem is first solved with no recomputation.  Where each rank runs one stage,
    the split and every stage's policy are also chosen together ([Note: split and
    recomputation chosen together] in partitioner/solve/policies.py), and that plan kept
    where it is faster (a faster split may recompute where a slower one need not) or
    where nothing fits without recomputation (a plan that fits only by offloading
    activations stands, as the search prefers offloading to recomputing): the Prepared is
    posed with "full", the most any stage may take, and each rank lowered to the cheapest
    policy that fits (`cheapest_per_rank`), which is the policy the DP chose for it.  On a
    graph that is not a chain, or where the joint plan's messages miss the DP's bound
    (where CP-SAT may find a plan no DP sees), the uniform approach below is solved too, and the faster plan by the cost model kept.  The mesh
    search (driver/search.py) tries the joint choice only where no plan fits without
    recomputation, to keep each candidate one DP.  Where ranks
    run several stages (interleaved, zb-v), or the joint DP finds nothing, the split is
    solved with every stage on the cheapest policy that lets some plan fit, trying
    selective, then full (`LEVELS`); then, with that split fixed, each pipeline rank whose
    stages fit with a cheaper policy takes the cheapest that fits, all its stages alike (a
    rank holds them all, [Note: activations in flight] in runtime/schedule/registry.py).
    Every rank's memory is the cost model's under its own policy, never over --memory.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from partitioner.errors import InfeasiblePlanError
from partitioner.ir import Plan, SolverReport
from partitioner.solve.model import rank_costs
from partitioner.solve.policies import solve_policies
from partitioner.solve.problem import make_plan, pose

from .options import AUTO
from .prepared import Prepared

__all__ = ["LEVELS", "VARIANTS", "cheapest_per_rank", "joins", "plan_policy", "planned", "solve_cheapest_policy",
           "solve_jointly", "variant_rank", "with_policy"]

#: the policies in order of the time they add ([Note: recomputation chosen per rank])
LEVELS: tuple[str | None, ...] = (None, "selective", "full")
#: what `--recompute auto` tries in order: none, each stage its own (AUTO), then one policy for all
VARIANTS: tuple[str | None, ...] = (None, AUTO, "selective", "full")

_Solve = Callable[[Prepared], tuple[Prepared, tuple[int, ...], SolverReport]]
_Solved = tuple[Prepared, tuple[int, ...], SolverReport]


def with_policy(p: Prepared, policy: str | None) -> Prepared:
    """`p` posed again with every stage on `policy` (same trace, costs and blocks); AUTO
    as "full", the most a stage may take ([Note: recomputation chosen per rank])."""
    assert p.coarse is not None
    mesh = dataclasses.replace(p.mesh, recompute="full" if policy == AUTO else policy)
    return dataclasses.replace(p, mesh=mesh, problem=pose(p.coarse, mesh, p.hardware))


def joins(p: Prepared) -> bool:
    """Whether the split and the policies can be chosen together: one stage per rank."""
    return p.mesh.virtual_stages == 1


def solve_jointly(p: Prepared) -> tuple[Prepared, tuple[int, ...], SolverReport]:
    """`p` posed with "full" and the split the joint DP chose ([Note: split and
    recomputation chosen together] in partitioner/solve/policies.py); `planned` then gives
    each stage its policy.  InfeasiblePlanError where no mix fits."""
    assignment, _, report = solve_policies([with_policy(p, level).problem for level in LEVELS])
    return with_policy(p, AUTO), assignment, report


def solve_cheapest_policy(p: Prepared, solve_one: _Solve) -> _Solved:
    """The plan of `--recompute auto` ([Note: recomputation chosen per rank]): the joint
    choice where it is faster than `solve_one` with no recomputation (which stands where
    it offloads); where that does not fit, the joint choice, else (or where faster, off a
    chain) the first of selective and full under which `solve_one` finds a plan; the
    last error."""
    try:
        none: _Solved | None = solve_one(with_policy(p, None))
    except InfeasiblePlanError:
        p.say("--recompute auto: no plan fits without recomputation; choosing the split and each stage's policy")
        none = None
    if none is not None and (none[0].problem.offload or not joins(p)):
        return none  # offloading comes before recomputation, as in the search (`offloading.variants`)
    joint = _jointly(p)
    if none is not None:  # a faster split may recompute where a slower one need not
        return joint if joint is not None and _slowest_rank(joint) < _slowest_rank(none) * (1 - 1e-9) else none
    if joint is not None and joint[2].status == "OPTIMAL":  # a chain whose plan meets the DP's bound
        return joint
    try:
        uniform = _uniform(p, solve_one)
    except InfeasiblePlanError:
        if joint is None:
            raise
        return joint
    return joint if joint is not None and _slowest_rank(joint) < _slowest_rank(uniform) else uniform


def _jointly(p: Prepared) -> _Solved | None:
    """`solve_jointly` where it serves and finds a plan, else None."""
    if not joins(p):
        return None
    try:
        return solve_jointly(p)
    except InfeasiblePlanError:
        return None


def _uniform(p: Prepared, solve_one: _Solve) -> _Solved:
    """The first of selective and full under which `solve_one` finds a plan that fits;
    the last policy's error where none does."""
    for policy in LEVELS[1:]:
        try:
            return solve_one(with_policy(p, policy))
        except InfeasiblePlanError:
            if policy == LEVELS[-1]:
                raise
            p.say(f"--recompute auto: no plan fits with recomputation {policy} on every stage; trying the next")
    raise AssertionError("unreachable: the last level raises")


def _slowest_rank(solved: _Solved) -> float:
    """The slowest rank's time of a solved plan, each rank on its policy (`planned`)."""
    plan = planned(*solved)
    ranks = [0.0] * plan.pp
    for s in plan.stages:
        ranks[plan.rank_of(s.index)] += s.time_s
    return max(ranks)


def variant_rank(policy: str | None) -> int:
    """Where a policy (or AUTO, a mix) stands in `VARIANTS`: the order of the time it adds."""
    return VARIANTS.index(policy)


def plan_policy(plan: Plan) -> str | None:
    """The policy every stage of `plan` follows, or AUTO where they differ."""
    policies = {plan.policy(k) for k in range(plan.num_stages)}
    return policies.pop() if len(policies) == 1 else AUTO


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
