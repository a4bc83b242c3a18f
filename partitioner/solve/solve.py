"""Assign the blocks of a `PartitionProblem` to pipeline stages (with OR-Tools' CP-SAT, as tp/choose.py does),
minimising the cost model of `model` ([Note: the cost model] there).

Two steps (torchgpipe's `blockpartition` and PipeDream solve the first alone):
    1. An exact DP over contiguous runs of the block order (`intervals`; for zb-v's V,
       whose ranks run two runs each, over pairs of runs: `vee`).  Every such plan is
       valid; when each block feeds the next (a chain) every valid plan is one, and the
       DP is the optimum.  Interleaved 1F1B is paced by its slowest virtual stage
       ([Note: what the schedule runs] in model.py), which the interval DP minimises
       over the pp x v stages; each rank's memory, its stages' summed, is met by holding
       every stage to 1/v of the limit, and the DP without the limit gives the bound.
    2. Otherwise CP-SAT on the general DAG (`cpsat`), warm-started with the DP plan,
       which it replaces only if strictly better; its proved bound is reported.
       Deterministic: deterministic time limit, fixed seed, interleaved search.

[Note: CP-SAT not on interleaved chains]
    On a chain, interleaved 1F1B's DP plan is not handed to CP-SAT even where it misses
    the DP's bound (a value that skips blocks, a residual, may or may not come from the
    same rank, and the bound charges it as free): the slowest virtual stage is itself
    only a proxy of the step, which the driver settles by simulating candidate splits
    ([Note: splits chosen by the simulator] in driver/phases.py), and CP-SAT on
    pp x v stages takes its whole time limit for a few percent of that proxy.

Ties are not left to chance (`plan_key`): among plans with the same slowest rank, both
steps prefer the least sum of the ranks' excess over the mean compute, then the fewest
bytes sent between ranks; so no rank gets a lone cheap node while another plan with the
same slowest rank spreads the work.

[Note: every stage computes]
    No stage is left without a block that computes unless there are fewer such blocks
    than stages (`fills_with_compute`; the compile warns, naming the counts).  A block
    computes when one of its nodes works on the data (`cost.nodes.working_nodes`): it
    reads a graph input or a parameter through other nodes and is not a view of its
    input (`node.meta["aliases"]`, recorded by trace.passes.propagate).  So a stage of
    only a reshape, of a BatchNorm's `num_batches_tracked += 1`, or of a mask built from
    constants is never chosen, though each costs some time.  Both steps keep the rule:
    the DP gives a run that holds no such block infinite cost (`intervals`), CP-SAT asks
    every stage for one (`cpsat`), and `violations` checks it.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Sequence

import numpy as np

from ..errors import BeyondCapError, InfeasiblePlanError, PlanError
from ..cost.costmodel import param_bytes_once
from .cpsat import CpResult, solve_cpsat
from .intervals import dp_balanced, dp_memory, dp_time
from .model import (RankCost, StageCost, evaluate, fills_with_compute, interleaved, key_below, memory_unit, objective,
                    plan_key, rank_costs, stage_costs, violations)
from .vee import vee_memory, vee_plans
from ..ir import PartitionProblem, SolverReport

__all__ = ["CpResult", "RankCost", "StageCost", "even_split", "evaluate", "fills_with_compute", "is_chain", "objective", "plan_key",
           "rank_costs", "solve", "solve_cpsat", "stage_costs", "violations"]


def _better(problem: PartitionProblem, a: Sequence[int], b: Sequence[int] | None) -> bool:
    """Whether plan `a` is lexicographically better than `b` (`plan_key`, times equal to
    a relative 1e-9)."""
    return b is None or key_below(plan_key(problem, a), plan_key(problem, b))


# -- step 1: the contiguous plans (`intervals`, `vee`) ------------------------------------


def _contiguous(problem: PartitionProblem, cap_s: float = math.inf
                ) -> tuple[tuple[int, ...] | None, float, bool, bool]:
    """The best contiguous plan a DP finds (the most balanced of the fastest), the bound it
    minimised, whether that bound holds for every contiguous plan: where the DP sums
    what each rank runs, one stage per rank (`intervals`) or zb-v's V (`vee`), or what
    paces interleaved 1F1B, each stage (`_interleaved_plans`); and whether the plan is
    final, CP-SAT not asked ([Note: CP-SAT not on interleaved chains]).  `cap_s`: [Note:
    a cap on a rank's compute]."""
    upper = _even_split_time(problem)
    settled = False
    if problem.virtual_stages == 1:
        dp, bound = dp_time(problem, upper, cap_s)
        balanced = dp_balanced(problem, bound) if dp is not None else None
    elif problem.spec.vee:
        start = _per_stage_plan(problem)
        dp, balanced, bound = vee_plans(problem, min(upper, objective(problem, start)) if start is not None else upper,
                                        cap_s)
    else:
        dp, balanced, bound, settled = _interleaved_plans(problem, upper)
        if dp is None:  # none fits with 1/v of the memory per stage: some may with uneven stages
            return None, bound, False, False
    if balanced is not None and _better(problem, balanced, dp):
        dp = balanced
    return dp, bound, True, settled


def _interleaved_plans(problem: PartitionProblem, upper_s: float
                       ) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None, float, bool]:
    """Interleaved 1F1B's fastest contiguous plan (the slowest virtual stage least,
    [Note: what the schedule runs] in model.py), its most balanced equal, the bound of
    every contiguous plan (the DP's without the memory limit), and whether the memory
    left the plan alone.  Where the plan without the limit does not fit, every stage is
    held to 1/v of the limit, so that every rank's stages fit together; a plan that fits
    only with uneven stages on a rank is left to CP-SAT."""
    unlimited = replace(problem, memory_limit_bytes=None)
    free, bound = dp_time(unlimited, upper_s)
    if free is None or math.isfinite(objective(problem, free)):
        return free, dp_balanced(unlimited, bound) if free is not None else None, bound, True
    held = _per_stage_memory(problem)
    dp = dp_time(held, math.inf)[0]
    if dp is None:
        return None, None, bound, False
    return dp, dp_balanced(held, max(bound, objective(problem, dp))), bound, False


def _per_stage_memory(problem: PartitionProblem) -> PartitionProblem:
    """`problem` with every stage held to 1/virtual_stages of the memory limit."""
    limit = problem.memory_limit_bytes
    return replace(problem, memory_limit_bytes=limit // problem.virtual_stages if limit is not None else None)


def _per_stage_plan(problem: PartitionProblem) -> tuple[int, ...] | None:
    """The interval DP's plan with every stage on a rank of its own and 1/virtual_stages
    of the memory: each rank's stages then fit together."""
    limit, v = problem.memory_limit_bytes, problem.virtual_stages
    alone = replace(problem, virtual_stages=1, memory_limit_bytes=limit // v if limit is not None else None)
    return dp_time(alone, _even_split_time(alone))[0]


def _even_split_time(problem: PartitionProblem) -> float:
    """The objective of the plan that splits compute evenly (inf if it is invalid)."""
    return objective(problem, even_split(problem))


def even_split(problem: PartitionProblem) -> tuple[int, ...]:
    """The contiguous plan whose stages split the compute most evenly by prefix sums, each
    stage given a block at least (not checked against memory)."""
    n, stages = problem.num_blocks, problem.stages
    prefix = np.cumsum(problem.block_time_s)
    cuts = [0] + [int(c) + 1 for c in np.searchsorted(prefix, prefix[-1] * np.arange(1, stages) / stages)]
    for j in range(1, stages):  # strictly increasing, leaving a block for every later stage
        cuts[j] = min(max(cuts[j], cuts[j - 1] + 1), n - stages + j)
    plan = [0] * n
    for k, (a, b) in enumerate(zip(cuts, cuts[1:] + [n])):
        plan[a:b] = [k] * (b - a)
    return tuple(plan)


def is_chain(problem: PartitionProblem) -> bool:
    """Whether every valid plan is contiguous: one stage, or each block feeds the next (the
    DPs of step 1 then search every plan, and CP-SAT only polishes what memory left over)."""
    linked = {e.src for e in problem.edges if e.dst == e.src + 1}
    return problem.stages == 1 or all(i in linked for i in range(problem.num_blocks - 1))


# -- the solver ---------------------------------------------------------------------------


def solve(problem: PartitionProblem, time_limit_s: float = 30.0, *, seed: int = 0, workers: int = 1,
          nodes: int = 0, explain: bool = True, cap_s: float = math.inf) -> tuple[tuple[int, ...], SolverReport]:
    """The stage of each block, and how it was found.

    `time_limit_s` is CP-SAT's deterministic time (about seconds, the same on every run);
    `nodes` is only reported.  Raises PlanError when the stages cannot all be filled and
    InfeasiblePlanError when no plan fits the memory limit (with `explain`, naming the
    fullest stage and the stage counts that would fit, which costs a DP per count).
    `cap_s`: a rank's compute per microbatch over which no plan is of use; the plan is
    the one solved without it, or BeyondCapError is raised ([Note: a cap on a rank's
    compute]).

    [Note: a cap on a rank's compute]
        A search knows the best step found so far, and a plan one of whose ranks
        computes more than that step over M per microbatch is slower (`bound` in
        driver/ranking.py; less the least of what follows the walk, which every plan
        pays: `Beaten.cap_s`).  Given that cap, the DPs of one stage per rank and of zb-v's
        V leave out what exceeds it, which is most of their work where the cap is near
        the mean rank; they either return the plan they return without it, or find
        none and raise BeyondCapError: no plan fits, or none is of use.  A DP's known
        plan bound (`upper_s`) only prunes, so the DP is exact wherever its optimum
        lies within the bound it is given:
          - one stage per rank (`dp_time`): runs whose time exceeds the cap plus the
            most messages any run can be charged (its time over its compute) are left
            out, and so is an optimum over that: each computes over the cap, so the DP
            is exact or finds none;
          - the V (`vee_plans`): the same with a rank's two runs;
          - split and policies chosen together (`solve_policies` in policies.py): as one
            stage per rank, each policy's runs by their own time.
        Interleaved 1F1B, paced by its slowest virtual stage under a memory held to 1/v
        per stage, takes no cap.
    """
    start = time.perf_counter()
    _check(problem)
    limit = problem.memory_limit_bytes
    if not explain and limit is not None and _held_alone(problem) > limit * problem.ranks + problem.stages:
        raise InfeasiblePlanError(f"no plan into {problem.stages} stages fits {_size(limit)} per "
                                  f"{memory_unit(problem)}: the weights, gradients and optimizer state alone need "
                                  f"{_size(_held_alone(problem) // problem.ranks)} per rank")
    dp, dp_bound, summed, settled = _contiguous(problem, cap_s)
    exact = summed and is_chain(problem)  # every valid plan is contiguous: the DP's bound holds for all of them
    report = SolverReport(method="dp", objective_s=0.0, lower_bound_s=0.0, wall_s=0.0, status="OPTIMAL",
                          blocks=problem.num_blocks, nodes=nodes)
    best, bound = dp, max(_trivial_bound(problem), dp_bound if exact else 0.0)
    if exact and (dp is None or objective(problem, dp) <= dp_bound * (1 + 1e-9)):
        bound = math.inf  # the DP's plan meets the bound of every valid plan
    elif exact and settled:
        report = replace(report, status="FEASIBLE")  # [Note: CP-SAT not on interleaved chains]
    elif time_limit_s > 0:
        upper = objective(problem, dp) if dp is not None else None  # inf: the DP counts messages it is sure of alone
        upper = upper if upper is not None and math.isfinite(upper) else None
        cp = solve_cpsat(problem, time_limit_s, hint=dp, upper_bound_s=upper, seed=seed, workers=workers)
        bound = max(bound, cp.lower_bound_s)
        report = replace(report, method="dp+cpsat", status=cp.status)
        if cp.assignment is not None and _better(problem, cp.assignment, dp):
            best, report = cp.assignment, replace(report, method="cpsat")
    else:
        report = replace(report, status="FEASIBLE")
    if best is None or not math.isfinite(objective(problem, best)):
        search = "chain" if exact and _summed(problem) else "proved" if report.status == "INFEASIBLE" else "unknown"
        if math.isfinite(cap_s) and _summed(problem):
            raise BeyondCapError(f"no plan into {problem.stages} stages fits with every rank's compute within "
                                 f"{cap_s * 1e3:.3f} ms a microbatch", cap_s)
        if not explain:
            limit = problem.memory_limit_bytes or 0
            raise InfeasiblePlanError(f"no plan into {problem.stages} stages fits {_size(limit)} per {memory_unit(problem)}")
        raise _infeasible(problem, search)
    slowest = objective(problem, best)
    return best, replace(report, objective_s=slowest, lower_bound_s=min(bound, slowest),
                         wall_s=time.perf_counter() - start)


def _check(problem: PartitionProblem) -> None:
    n, stages, virtual = problem.num_blocks, problem.stages, problem.virtual_stages
    if stages < 1:
        raise PlanError(f"{_flag(problem, stages)}: a pipeline needs at least one stage.")
    if stages > n:
        asked = _flag(problem, stages) + (f" makes {stages} stages, which" if virtual > 1 else "")
        fix = f"use {_flag(problem, n, down=True)} or fewer" if n >= virtual else f"use --virtual-stages {n} or fewer"
        raise PlanError(f"{asked} is more than the {n} blocks the graph coarsened into, and every "
                        f"stage needs at least one block: {fix}.")
    if problem.microbatches < 1:
        raise PlanError(f"--microbatches {problem.microbatches}: need at least one microbatch.")


def _held_alone(problem: PartitionProblem) -> int:
    """The weights, gradients and optimizer state of every parameter, each held once: the
    ranks hold at least this together, whatever the plan (a rank's is its stages' rounded
    sum, less the copies of a shared parameter: at most a byte a stage more)."""
    return round(param_bytes_once(problem) * (2 + problem.optimizer_factor))


def _trivial_bound(problem: PartitionProblem) -> float:
    """No plan beats its largest block, nor an even share of all compute among what paces
    the schedule (ranks, or the stages of interleaved 1F1B)."""
    times = problem.block_time_s
    return max(max(times), sum(times) / (problem.stages if interleaved(problem) else problem.ranks))


# -- infeasible: both sides and the fix --------------------------------------------------


def _infeasible(problem: PartitionProblem, search: str) -> InfeasiblePlanError:
    """Name the leanest plan's fullest rank, its parts, and what would fit instead."""
    limit = problem.memory_limit_bytes
    assert limit is not None
    lean = _leanest(problem)
    assert lean is not None
    costs = stage_costs(problem, lean)
    ranks = rank_costs(problem, lean, costs)
    c = max(ranks, key=lambda r: r.memory_bytes)
    mine, need, unit = [costs[k] for k in c.stages], _size(c.memory_bytes), memory_unit(problem)
    where = f"stage {c.stages[0]} (" if unit == "stage" else f"rank {ranks.index(c)} (stages {_and(c.stages)}: "
    many = len(mine) > 1 or mine[0].inflight != 1
    flight = f"{_and([s.inflight for s in mine])} microbatch{'es' if many else ''} in flight"
    parts = (f"weights {_size(c.weight_bytes)}, gradients {_size(c.weight_bytes)}, optimizer "
             f"{_size(round(c.weight_bytes * problem.optimizer_factor))}, ")
    if problem.recompute:
        parts += (f"activations {_size(sum(s.activation_bytes for s in mine))} of the microbatch recomputed, "
                  f"inputs {_size(sum(s.input_bytes * s.inflight for s in mine))} for {flight}")
    else:
        parts += f"activations {_size(sum(s.activation_bytes * s.inflight for s in mine))} for {flight}"
    if any(s.seed_bytes for s in mine):
        parts += f", weight-gradient seeds {_size(sum(s.seed_bytes for s in mine))} for the W's held back"
    into = f"into {problem.stages} stage{'s' if problem.stages != 1 else ''}"
    if problem.virtual_stages > 1:
        into += f" ({problem.ranks} x {problem.virtual_stages} virtual stages per rank)"
    head = {"chain": f"every plan {into} needs at least {need} on one {unit}",
            "proved": f"CP-SAT proved that no plan {into} fits",
            "unknown": f"no plan {into} that fits was found within --time-limit"}[search]
    leanest = "the leanest" if _summed(problem) else "the leanest found"
    fits = _stages_that_fit(problem, limit)
    fits_note = " (fits)" if problem.virtual_stages == 1 else ", which fits,"
    fix = f"use {_flag(problem, fits)}{fits_note} or raise --memory to {need}" if fits else f"raise --memory to {need}"
    if not problem.recompute and _fits(replace(problem, recompute=True), limit):
        fix = f"recompute activations (--recompute fits), {fix}"
    more = " (or raise --time-limit)" if search == "unknown" else ""
    return InfeasiblePlanError(f"{head}: {leanest} puts {need} on {where}{parts}) but --memory is "
                               f"{_size(limit)} per {unit}: {fix}{more}.")


def _summed(problem: PartitionProblem) -> bool:
    """Whether a DP sums what each rank runs (`_contiguous`)."""
    return problem.virtual_stages == 1 or problem.spec.vee


def _leanest(problem: PartitionProblem, limit: int | None = None) -> tuple[int, ...] | None:
    """The contiguous plan with the least memory on its fullest rank (within `limit`, if
    given; None if none is): for interleaved, whose ranks no DP follows, on its fullest stage."""
    lean = dp_memory(problem)
    if lean is not None and problem.virtual_stages > 1 and problem.spec.vee:
        # the V's leanest is no fuller than `lean`'s fullest rank (to a byte of rounding per stage)
        return vee_memory(problem, limit if limit is not None else max(evaluate(problem, lean)[1]) + problem.stages)
    return lean if limit is None or lean is not None and max(evaluate(problem, lean)[1]) <= limit else None


def _fits(problem: PartitionProblem, limit: int) -> bool:
    """Whether the leanest contiguous plan of `problem` fits `limit` on every rank."""
    return _leanest(problem, limit) is not None


def _stages_that_fit(problem: PartitionProblem, limit: int, most: int = 64) -> int | None:
    """The smallest stage count above the problem's whose leanest contiguous plan fits,
    among the multiples of its virtual stages that the schedule can run its microbatches on
    (those a --stages value can ask for)."""
    v = problem.virtual_stages
    for stages in range(problem.stages + v, min(problem.num_blocks, problem.stages + most * v) + 1, v):
        if problem.microbatches % problem.spec.microbatch_multiple(stages // v):
            continue  # a stage count the schedule cannot run these microbatches on (interleaved)
        if _fits(replace(problem, stages=stages), limit):
            return stages
    return None


def _and(items: Sequence[object]) -> str:
    """'0', '0 and 3', '0, 2 and 4'."""
    words = [str(i) for i in items]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def _flag(problem: PartitionProblem, stages: int, *, down: bool = False) -> str:
    """The --stages value that asks for `stages` stages: a count per rank, rounded up (down
    for a most), when each rank runs several: "--stages 3 (x 2 virtual stages per rank)"."""
    v = problem.virtual_stages
    if v == 1:
        return f"--stages {stages}"
    return f"--stages {stages // v if down else -(-stages // v)} (x {v} virtual stages per rank)"


def _size(size: int) -> str:
    """Bytes for people: '21.4 GiB', '3.0 MiB', '12 B'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"
