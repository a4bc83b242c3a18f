"""The cost model the solver minimises: each stage's and each pipeline rank's time and
memory under an assignment, and what makes an assignment a valid plan.

[Note: the cost model]
    `stage_costs` and `rank_costs` are the one definition of the model of the
    `PartitionProblem` docstring; `evaluate`, `objective`, the DPs (`intervals`, `vee`),
    the CP-SAT model and the tests follow them, reading the same tables (`costmodel`).
    A value is a (producer block, name) pair: a stage receives once each value that its
    blocks read from earlier stages, and sends each value it makes once to each later
    stage that reads it; the values a stage pair exchanges are one message, forward and
    backward ([Note: the cost of a boundary] in cost/costmodel.py).  A parameter
    that several blocks read (tied) is held once per stage, and once per rank where a rank
    runs several of the stages that read it.  A rank's time and memory are its stages'
    summed; a message between two stages of one rank is free.  The last block holds the
    graph's output (`coarsen` puts it there) and lies in the last stage.

[Note: what the schedule runs]
    The solver minimises the time of what paces the schedule (`paces`).  A schedule of one
    stage per rank, and zb-v's V (whose rank runs its two stages' work back to back), is
    paced by its slowest rank, the sum of its stages.  Interleaved 1F1B is not: its steady
    state runs one virtual stage after another round the ranks, and with p ranks of v
    virtual stages of equal time t and M microbatches it takes (M v + p - 1) t, warm-up and
    cool-down included (the schedule `runtime.schedule.interleaved_1f1b` lowers, replayed
    by `predict.simulate`; tests check it).  So the slowest virtual stage paces it, and
    every virtual stage is balanced, not only each rank's sum (at most v times the slowest
    stage).  With unequal stages the closed form, (M v + p - 1) x the slowest stage
    (`interleaved_step_s`), is no longer exact (in the cases tested it is above the
    simulated step): the driver chooses among a few candidate splits by the simulator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from ..cost.costmodel import boundary_s, computing_blocks, remote, shared_params, stage_pairs, values
from ..cost.roofline import stage_memory_bytes
from ..ir import PartitionProblem

__all__ = ["RankCost", "StageCost", "after_bytes", "evaluate", "fills_with_compute", "interleaved", "interleaved_step_s", "key_below",
           "memory_unit", "objective", "paces", "plan_key", "rank_costs", "stage_costs", "violations"]


@dataclass(frozen=True)
class StageCost:
    """One stage's terms of the cost model; traffic counts forward and backward."""

    compute_s: float
    messages: int
    traffic_bytes: int
    weight_bytes: int
    activation_bytes: int
    inflight: int
    time_s: float
    memory_bytes: int
    input_bytes: int = 0  # values received from earlier stages, once each (forward)
    link_bytes: int = 0  # of those, the bytes received from other ranks (the rest are handed over in memory)
    seed_bytes: int = 0  # of memory_bytes, the seeds kept for the W's held back (`PartitionProblem.awaiting_w`)


@dataclass(frozen=True)
class RankCost:
    """One pipeline rank's terms: the sums over the stages it runs, a parameter that
    several of them read held once (the runtime shares it)."""

    stages: tuple[int, ...]
    compute_s: float
    time_s: float
    weight_bytes: int
    memory_bytes: int
    link_bytes: int  # received from other ranks, each value once per stage that reads it


def stage_costs(problem: PartitionProblem, assignment: Sequence[int]) -> tuple[StageCost, ...]:
    """Every stage's compute, traffic and memory under `assignment` (a stage per block)."""
    stages = problem.stages
    compute, acts, weights, kept, seeds = [0.0] * stages, [0] * stages, [0] * stages, [0] * stages, [0] * stages
    own, shared = shared_params(problem)
    for block, k in enumerate(assignment):
        compute[k] += problem.block_time_s[block]
        acts[k] += problem.block_activation_bytes[block]
        kept[k] += problem.block_kept_bytes[block] if problem.block_kept_bytes else 0
        seeds[k] += problem.block_seed_bytes[block] if problem.block_seed_bytes else 0
        weights[k] += own[block]
    for size, blocks in shared:
        for k in {assignment[b] for b in blocks}:
            weights[k] += size
    pairs = stage_pairs(problem, assignment)
    linked = remote(pairs, problem.placement)
    comm_s = boundary_s(linked, problem.comm_alpha_s, problem.comm_beta_s_per_byte, stages)
    messages, traffic, received, over_links = [0] * stages, [0] * stages, [0] * stages, [0] * stages
    for (a, b), nbytes in pairs.items():
        received[b] += nbytes
    for (a, b), nbytes in linked.items():
        for k in (a, b):
            messages[k] += 2
            traffic[k] += 2 * nbytes
        over_links[b] += nbytes
    awaited = [seeds[k] * problem.awaiting_w(k) for k in range(stages)]
    held = _messages_held(problem, assignment, over_links) if problem.holds_messages else [0] * stages
    return tuple(
        StageCost(compute[k], messages[k], traffic[k], weights[k], acts[k], problem.inflight(k),
                  compute[k] + comm_s[k],
                  stage_memory_bytes(weights[k], acts[k], problem.resident(k), problem.optimizer_factor,
                                     recompute=problem.recompute, input_bytes=received[k], kept_bytes=kept[k],
                                     working_bytes=problem.working_bytes, message_bytes=held[k],
                                     microbatches=problem.microbatches, after_bytes=after_bytes(problem, weights[k]))
                  + awaited[k],
                  received[k], over_links[k], awaited[k])
        for k in range(stages)
    )


def _messages_held(problem: PartitionProblem, assignment: Sequence[int], received: Sequence[int]) -> list[int]:
    """Per stage, the bytes per microbatch of its messages with other ranks that the
    memory model holds (`PartitionProblem`): what it receives (`received`) and each value
    it sends once, however many stages read it (the DPs' count, `intervals`)."""
    held, placed = list(received), problem.placement
    for v in values(problem):
        k = assignment[v.producer]
        if any(placed[assignment[r]] != placed[k] for r in v.readers if assignment[r] > k):
            held[k] += v.bytes
    return held


def after_bytes(problem: PartitionProblem, weight_bytes: int) -> int:
    """What a stage holding `weight_bytes` of parameters holds after its last backward
    beyond its weights' terms and its sends: the optimizer step's temporaries, or with
    data parallelism its gradients' copy in the all-reduce's buckets, whichever is more."""
    return max(problem.step_bytes, weight_bytes if problem.buckets else 0)


def rank_costs(problem: PartitionProblem, assignment: Sequence[int],
               costs: Sequence[StageCost] | None = None) -> tuple[RankCost, ...]:
    """Every pipeline rank's time and memory under `assignment`: its stages' sums
    (`costs`, the stages' own, computed if not given)."""
    costs = costs if costs is not None else stage_costs(problem, assignment)
    placed, (_, shared) = problem.placement, shared_params(problem)
    out = []
    for r in range(problem.ranks):
        mine = tuple(k for k in range(problem.stages) if placed[k] == r)
        copies = sum(size * (len(on) - 1) for size, blocks in shared
                     for on in [{assignment[b] for b in blocks} & set(mine)] if on)
        out.append(RankCost(mine, sum(costs[k].compute_s for k in mine), sum(costs[k].time_s for k in mine),
                            sum(costs[k].weight_bytes for k in mine) - copies,
                            sum(costs[k].memory_bytes for k in mine) - round(copies * (2 + problem.optimizer_factor)),
                            sum(costs[k].link_bytes for k in mine)))
    return tuple(out)


def evaluate(problem: PartitionProblem, assignment: Sequence[int]) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """(time of each pipeline rank, memory of each) under `assignment`: of each stage
    where every rank runs one."""
    ranks = rank_costs(problem, assignment)
    return tuple(c.time_s for c in ranks), tuple(c.memory_bytes for c in ranks)


def violations(problem: PartitionProblem, assignment: Sequence[int],
               ranks: Sequence[RankCost] | None = None) -> list[str]:
    """What makes `assignment` invalid (empty when it is a valid plan); `ranks`: its
    `rank_costs`, where known."""
    found = _misplaced(problem, assignment)
    if found:
        return found
    limit, unit = problem.memory_limit_bytes, memory_unit(problem)
    memories = [c.memory_bytes for c in (ranks if ranks is not None else rank_costs(problem, assignment))]
    return [f"{unit} {k} needs {m} bytes > {limit}" for k, m in enumerate(memories) if limit is not None and m > limit]


def _misplaced(problem: PartitionProblem, assignment: Sequence[int]) -> list[str]:
    """What makes `assignment` invalid but memory."""
    n, stages = problem.num_blocks, problem.stages
    if len(assignment) != n or any(not 0 <= k < stages for k in assignment):
        return [f"need {n} stages in [0, {stages})"]
    found = [f"edge {e.src}->{e.dst} goes backward" for e in problem.edges if assignment[e.src] > assignment[e.dst]]
    found += [f"stage {k} is empty" for k in sorted(set(range(stages)) - set(assignment))]
    if fills_with_compute(problem):
        busy = {assignment[i] for i in computing_blocks(problem)}
        found += [f"stage {k} has no compute" for k in sorted(set(assignment) - busy)]
    if assignment[-1] != stages - 1:
        found.append("the output block is not in the last stage")
    return found


def objective(problem: PartitionProblem, assignment: Sequence[int]) -> float:
    """The time of what paces the schedule, the slowest ([Note: what the schedule runs]):
    a rank, or under interleaved 1F1B a virtual stage; inf when `assignment` is not a valid plan."""
    return plan_key(problem, assignment)[0]


def interleaved(problem: PartitionProblem) -> bool:
    """Whether ranks run several stages that interleaved 1F1B paces one by one (not zb-v's
    V, whose rank runs its two as one): [Note: what the schedule runs]."""
    return problem.virtual_stages > 1 and not problem.spec.vee


def paces(problem: PartitionProblem, assignment: Sequence[int]) -> tuple[float, ...]:
    """The times whose most paces the schedule ([Note: what the schedule runs]): each
    stage's under interleaved 1F1B, else each rank's."""
    costs = stage_costs(problem, assignment)
    return _paces(problem, costs, rank_costs(problem, assignment, costs))


def _paces(problem: PartitionProblem, costs: Sequence[StageCost], ranks: Sequence[RankCost]) -> tuple[float, ...]:
    return tuple(c.time_s for c in (costs if interleaved(problem) else ranks))


def interleaved_step_s(problem: PartitionProblem, slowest_stage_s: float) -> float:
    """Interleaved 1F1B's step with every virtual stage taking `slowest_stage_s`:
    (M v + p - 1) of them ([Note: what the schedule runs])."""
    return (problem.microbatches * problem.virtual_stages + problem.ranks - 1) * slowest_stage_s


def fills_with_compute(problem: PartitionProblem) -> bool:
    """Whether every stage can get a block that computes (positive time): otherwise the
    user asked for more stages than the graph can fill, and some stage only moves data."""
    return len(computing_blocks(problem)) >= problem.stages


def plan_key(problem: PartitionProblem, assignment: Sequence[int]) -> tuple[float, float, int]:
    """What `solve` minimises, in order: the slowest rank, or virtual stage under
    interleaved 1F1B (`objective`; inf when invalid), the sum of their excess over the
    mean compute (balance), the bytes sent between ranks (each value once per stage that
    receives it).  The plan is costed once: a solve asks for the same few plans' keys of
    one problem several times, which are kept (`_Keys`)."""
    return _keys.of(problem, tuple(assignment))


def _plan_key(problem: PartitionProblem, assignment: tuple[int, ...]) -> tuple[float, float, int]:
    if _misplaced(problem, assignment):
        return (math.inf, math.inf, 0)
    costs = stage_costs(problem, assignment)
    ranks = rank_costs(problem, assignment, costs)
    if violations(problem, assignment, ranks):
        return (math.inf, math.inf, 0)
    times = _paces(problem, costs, ranks)
    mean = sum(problem.block_time_s) / len(times)
    return (max(times), sum(max(0.0, t - mean) for t in times), sum(c.link_bytes for c in ranks))


#: the most plan keys kept (a brute force asks for every plan's)
_KEPT = 1024


class _Keys:
    """The plan keys of the last problem asked about, by plan: a problem is frozen, and the
    one held keeps its identity its own."""

    def __init__(self) -> None:
        self.problem: PartitionProblem | None = None
        self.keys: dict[tuple[int, ...], tuple[float, float, int]] = {}

    def of(self, problem: PartitionProblem, assignment: tuple[int, ...]) -> tuple[float, float, int]:
        if problem is not self.problem or len(self.keys) >= _KEPT:
            self.problem, self.keys = problem, {}
        if assignment not in self.keys:
            self.keys[assignment] = _plan_key(problem, assignment)
        return self.keys[assignment]


_keys = _Keys()


def key_below(a: tuple[float, float, int], b: tuple[float, float, int]) -> bool:
    """Whether plan key `a` (`plan_key`'s: slowest, excess, bytes) is lexicographically below
    `b`, times equal to a relative 1e-9."""
    if math.isinf(b[0]) or math.isinf(a[0]):  # an invalid plan is below none
        return a[0] < b[0]
    tol = 1e-9 * max(b[0], 1e-30)
    if abs(a[0] - b[0]) > tol:
        return a[0] < b[0]
    if abs(a[1] - b[1]) > tol:
        return a[1] < b[1]
    return a[2] < b[2]


def memory_unit(problem: PartitionProblem) -> str:
    """What the memory limit bounds, in words: a stage, where every rank runs one."""
    return "stage" if problem.virtual_stages == 1 else "rank"
