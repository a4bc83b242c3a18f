"""`--recompute auto`: the planner chooses none, selective or full recomputation per stage.

[Note: recomputation chosen per rank]
    The problem is first solved with no recomputation.  Where each rank runs one stage,
    the split and every stage's policy are also chosen together ([Note: split and
    recomputation chosen together] in partitioner/solve/policies.py; `fit_jointly`, which
    solves again under a lower limit where the walked peak exceeds --memory), and that
    plan is kept where it is faster by the cost model (a faster split may recompute
    where a slower one need not) or where nothing fits without recomputation; a plan that
    fits only by offloading activations stands, as the search prefers offloading to
    recomputing.  The joint plan's Prepared is posed with "full", the most any stage may
    take, and carries each stage's policy (`Prepared.policies`, read by `planned`).  On a
    graph that is not a chain, or where the joint plan's messages miss the DP's bound
    (CP-SAT may then find a plan no DP sees), the uniform approach below is solved too,
    and the faster plan kept.  The mesh search (driver/search.py) tries the joint choice
    only where no plan fits without recomputation, and once (`solve_jointly`: a candidate
    whose walked peak exceeds the limit is dropped there), to keep a candidate one DP.
    The uniform approach, where ranks run several stages (interleaved, zb-v) or the joint
    DP finds nothing: the split is solved with every stage on the cheapest policy that
    lets some plan fit, trying selective, then full (`LEVELS`); then, with that split
    fixed, each pipeline rank whose stages fit with a cheaper policy takes the cheapest
    that fits, all its stages alike (a rank holds them all, [Note: activations in
    flight] in runtime/schedule/registry.py).  Every rank's memory is the cost model's
    under its own policy, never over --memory.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

from partitioner.errors import InfeasiblePlanError
from partitioner.ir import Plan, SolverReport
from partitioner.solve.policies import solve_policies
from partitioner.solve.problem import make_plan, pose

from .memory import rank_peaks, ranks_over, stage_parts, undercount
from .options import AUTO
from .prepared import Prepared

__all__ = ["LEVELS", "VARIANTS", "WALK_ROUNDS", "cheapest_per_rank", "fit_jointly", "joins", "plan_policy", "planned",
           "recompute_block", "solve_cheapest_policy", "solve_jointly", "variant_rank", "with_policies", "with_policy"]

#: the policies in order of the time they add ([Note: recomputation chosen per rank])
LEVELS: tuple[str | None, ...] = (None, "selective", "full")
#: what `--recompute auto` tries in order: none, each stage its own (AUTO), then one policy for all
VARIANTS: tuple[str | None, ...] = (None, AUTO, "selective", "full")

#: how often the joint choice is solved again where the walked peak exceeds the limit (`fit_jointly`)
WALK_ROUNDS = 3

_Solve = Callable[[Prepared], tuple[Prepared, tuple[int, ...], SolverReport]]
_Solved = tuple[Prepared, tuple[int, ...], SolverReport]


def with_policy(p: Prepared, policy: str | None) -> Prepared:
    """`p` posed again with every stage on `policy` (same trace, costs and blocks); AUTO
    as "full", the most a stage may take ([Note: recomputation chosen per rank])."""
    assert p.coarse is not None
    mesh = dataclasses.replace(p.mesh, recompute="full" if policy == AUTO else policy)
    return dataclasses.replace(p, mesh=mesh, problem=pose(p.coarse, mesh, p.hardware), policies=None)


def joins(p: Prepared) -> bool:
    """Whether the split and the policies can be chosen together: one stage per rank."""
    return p.mesh.virtual_stages == 1


def solve_jointly(p: Prepared, limit: int | None = None, cap_s: float = math.inf) -> _Solved:
    """`p` posed with "full", each stage's policy and the split the joint DP chose for
    `limit` (default: `p`'s) ([Note: split and recomputation chosen together] in
    partitioner/solve/policies.py).  InfeasiblePlanError where no mix fits;
    BeyondCapError where none fits within `cap_s`, a rank's compute ([Note: a cap on a
    rank's compute] in partitioner/solve/solve.py)."""
    memory = limit if limit is not None else p.problem.memory_limit_bytes
    problems = [dataclasses.replace(with_policy(p, level).problem, memory_limit_bytes=memory) for level in LEVELS]
    assignment, chosen, report = solve_policies(problems, cap_s)
    return dataclasses.replace(with_policy(p, AUTO), policies=tuple(LEVELS[i] for i in chosen)), assignment, report


def fit_jointly(p: Prepared) -> _Solved:
    """`solve_jointly`, solved again with the limit lowered where the walked peak
    (driver/memory.py) exceeds it (`memory.undercount`), up to WALK_ROUNDS times, so that the plan fits by
    the walk the manifest reports as well as by the DP's cost model: each stage's
    policy is chosen as near the limit as the model allows, where the two may differ.
    InfeasiblePlanError where no mix fits, or none fits by the walk."""
    solved, limit = solve_jointly(p), p.problem.memory_limit_bytes
    for _ in range(WALK_ROUNDS):
        plan = planned(*solved)
        lower = undercount(p, plan, rank_peaks(p, plan))
        if lower <= 0:
            return solved
        assert limit is not None
        limit -= lower
        solved = solve_jointly(p, limit)
    raise InfeasiblePlanError(f"no split and policies found within {WALK_ROUNDS} rounds fit by the walked peak")


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
    if none is not None and not none[0].problem.offload and ranks_over(none[0], planned(*none)):
        p.say("--recompute auto: the split without recomputation exceeds the limit by its walked peak; choosing the "
              "split and each stage's policy")
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
        return fit_jointly(p)
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
    # by the walked peak the manifest reports, which a rank's own stages alone decide
    fits = [[limit is None or peak <= limit for peak in rank_peaks(p, with_policies(p, plan, assignment, [policy] * plan.num_stages))]
            for policy in LEVELS[:level]]
    chosen = [next((i for i in range(level) if fits[i][r]), level) for r in range(plan.pp)]
    return with_policies(p, plan, assignment, [LEVELS[chosen[plan.rank_of(k)]] for k in range(plan.num_stages)])


def with_policies(p: Prepared, plan: Plan, assignment: tuple[int, ...], policies: Sequence[str | None]) -> Plan:
    """`plan` with stage k's terms those of `policies[k]`."""
    plans = {policy: make_plan(with_policy(p, policy).problem, p.blocks, assignment, plan.report, p.mesh)
             for policy in set(policies)}
    mixed = dataclasses.replace(plan, stages=tuple(plans[policy].stages[k] for k, policy in enumerate(policies)),
                                recompute=False)
    return dataclasses.replace(mixed, recompute=all(policy == "full" for policy in policies))


def planned(p: Prepared, assignment: tuple[int, ...], report: SolverReport | None) -> Plan:
    """The Plan of `assignment` (a stage per block of `p`): each stage on the policy chosen
    with the split (`p.policies`), else each rank on the cheapest policy that fits under
    `--recompute auto` (`cheapest_per_rank`)."""
    plan = make_plan(p.problem, p.blocks, assignment, report, p.mesh)
    if p.policies is not None:
        return with_policies(p, plan, assignment, p.policies)
    return cheapest_per_rank(p, plan, assignment)


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
