"""The split and each stage's recomputation policy chosen together (`--recompute auto`).

[Note: split and recomputation chosen together]
    The problem is posed once per policy (none, selective, full: `problems`, cheapest
    first); they share blocks, edges, stages and the memory limit, and differ only in
    each block's time (the forward run again) and in what a stage keeps per microbatch
    in flight.  The interval DP (`intervals.dp_time_policies`) charges a run as stage k
    the least, over the policies under which its memory as stage k fits, of its time:
    each stage's memory is its own rank's, with the microbatches that rank holds in
    flight (under 1F1B the first rank holds the most, [Note: activations in flight] in
    runtime/schedule/registry.py).  So a split that gives the first rank fewer blocks,
    recomputed, and the last more, kept, is found where it is the fastest.  Each stage of
    the plan then takes the fastest policy under which it fits (`choose_policies`), which
    is the cheapest that fits, since each policy adds time to the one before.  A plan
    with one policy everywhere is among those searched, so on a chain (every plan
    contiguous) the plan is never slower, by the cost model, than the uniform policy's.
    Only where each rank runs one stage: interleaved and zb-v keep the uniform policy,
    lowered per rank after ([Note: recomputation chosen per rank] in driver/recompute.py).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Sequence

from ..errors import BeyondCapError, InfeasiblePlanError
from ..ir import PartitionProblem, SolverReport
from .intervals import dp_balanced_policies, dp_time_policies
from .model import key_below, rank_costs, stage_costs, violations
from .solve import even_split, is_chain

__all__ = ["choose_policies", "mixed_key", "solve_policies"]

#: a plan's key: its slowest stage, the sum of the stages' excess over the mean compute, bytes sent
_Key = tuple[float, float, int]


def choose_policies(problems: Sequence[PartitionProblem], assignment: Sequence[int]) -> tuple[int | None, ...]:
    """Each stage's policy, an index into `problems`: the fastest under which its memory
    fits the limit, the cheaper of equals; None where it fits under none."""
    return _chosen(problems, assignment)[0]


def _chosen(problems: Sequence[PartitionProblem], assignment: Sequence[int]
            ) -> tuple[tuple[int | None, ...], list[float]]:
    """`choose_policies`, and each stage's time under its policy (inf where none fits)."""
    costs = [stage_costs(p, assignment) for p in problems]
    limit = problems[0].memory_limit_bytes
    chosen: list[int | None] = []
    for k in range(problems[0].stages):
        fits = [i for i, c in enumerate(costs) if limit is None or c[k].memory_bytes <= limit]
        chosen.append(min(fits, key=lambda i: (costs[i][k].time_s, i)) if fits else None)
    return tuple(chosen), [math.inf if i is None else costs[i][k].time_s for k, i in enumerate(chosen)]


def mixed_key(problems: Sequence[PartitionProblem], assignment: Sequence[int]) -> _Key:
    """What `solve_policies` minimises, in order: the slowest stage, each on its policy of
    `choose_policies` (inf when one fits under none or the plan is invalid), the sum of the
    stages' excess over the mean compute, the bytes sent between stages."""
    first = problems[0]
    chosen, times = _chosen(problems, assignment)
    if None in chosen or violations(replace(first, memory_limit_bytes=None), assignment):
        return (math.inf, math.inf, 0)
    mean = sum(first.block_time_s) / first.stages
    sent = sum(c.link_bytes for c in rank_costs(first, assignment))
    return (max(times), sum(max(0.0, t - mean) for t in times), sent)


def solve_policies(problems: Sequence[PartitionProblem], cap_s: float = math.inf
                   ) -> tuple[tuple[int, ...], tuple[int, ...], SolverReport]:
    """The stage of each block and the policy of each stage (an index into `problems`,
    one per policy, cheapest first), the fastest plan by the interval DP, and how it was
    found ([Note: split and recomputation chosen together]).  Raises InfeasiblePlanError
    when no contiguous plan fits the limit under any mix of policies.  `cap_s`: a rank's
    compute over which no plan is of use, as for `solve` ([Note: a cap on a rank's
    compute] in solve.py)."""
    start, first = time.perf_counter(), problems[0]
    assert first.virtual_stages == 1, "one stage per rank: [Note: split and recomputation chosen together]"
    dp, bound = dp_time_policies(problems, mixed_key(problems, even_split(first))[0], cap_s)
    if dp is None and math.isfinite(cap_s):
        raise BeyondCapError(f"no plan into {first.stages} stages fits with every stage's compute within "
                             f"{cap_s * 1e3:.3f} ms a microbatch under any recomputation policy", cap_s)
    if dp is None:
        raise InfeasiblePlanError(f"no plan into {first.stages} stages fits {first.memory_limit_bytes} bytes per "
                                  f"stage under any recomputation policy")
    balanced = dp_balanced_policies(problems, bound)
    if balanced is not None and key_below(mixed_key(problems, balanced), mixed_key(problems, dp)):
        dp = balanced
    slowest = mixed_key(problems, dp)[0]
    if not math.isfinite(slowest):
        raise InfeasiblePlanError(f"the plan of the interval DP into {first.stages} stages does not fit "
                                  f"{first.memory_limit_bytes} bytes per stage")
    chosen = choose_policies(problems, dp)
    chain = is_chain(first)  # every valid plan is contiguous: the DP's bound holds for all of them
    exact = chain and slowest <= bound * (1 + 1e-9)
    floor = bound if chain else max(first.block_time_s)
    report = SolverReport(method="dp", objective_s=slowest, lower_bound_s=min(floor, slowest),
                          wall_s=time.perf_counter() - start, status="OPTIMAL" if exact else "FEASIBLE",
                          blocks=first.num_blocks)
    return dp, tuple(i for i in chosen if i is not None), report
