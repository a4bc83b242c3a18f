"""The schedule builders: each returns a compute-only schedule (F and B, or F, I and W
where the backward is split), one list of actions per pipeline rank.  The registry
(registry.py) names them; `lower` (lowering.py) adds the messages.
"""

from __future__ import annotations

from .. import zero_bubble
from ..errors import ScheduleError
from .actions import Action, B, F, Kind, Schedule

__all__ = ["gpipe", "one_f_one_b", "interleaved_1f1b", "interleaved_warmup", "zb_h1", "zb_h2", "zb_v"]


def gpipe(stages: int, microbatches: int) -> Schedule:
    """GPipe: every forward, then every backward (Huang et al. 2019)."""
    _check_counts(stages, microbatches)
    return [[Action(k, F, i) for i in range(microbatches)] + [Action(k, B, i) for i in range(microbatches)]
            for k in range(stages)]


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush, Narayanan et al. 2021): rank k warms up with S-1-k forwards,
    then alternates one forward and one backward, then cools down with the backwards left."""
    _check_counts(stages, microbatches)
    schedule = []
    for k in range(stages):
        warmup = min(stages - 1 - k, microbatches)
        row = [Action(k, F, i) for i in range(warmup)]
        for i in range(microbatches - warmup):
            row += [Action(k, F, warmup + i), Action(k, B, i)]
        row += [Action(k, B, i) for i in range(microbatches - warmup, microbatches)]
        schedule.append(row)
    return schedule


def interleaved_1f1b(ranks: int, virtual_stages: int, microbatches: int) -> Schedule:
    """Megatron-LM's interleaved 1F1B (Narayanan et al. 2021, section 2.2).

    Stage s lives on rank s % ranks; each rank runs its `virtual_stages` model chunks in
    groups of `ranks` microbatches.  Warm-up on rank r: (ranks-r-1)*2 + (v-1)*ranks
    forwards (all of them when microbatches == ranks), then 1F1B, then cool-down.
    """
    _check_counts(ranks, microbatches)
    if virtual_stages < 1:
        raise ScheduleError(f"virtual_stages={virtual_stages}: give at least 1 stage per rank.")
    if microbatches % ranks:
        raise ScheduleError(f"the interleaved schedule needs microbatches ({microbatches}) to be a multiple of "
                            f"the pipeline ranks ({ranks}): use {ranks * max(1, round(microbatches / ranks))} microbatches.")
    group, total = ranks * virtual_stages, microbatches * virtual_stages

    def action(r: int, k: int, kind: Kind) -> Action:
        chunk = (k % group) // ranks
        if kind == B:
            chunk = virtual_stages - 1 - chunk
        return Action(chunk * ranks + r, kind, (k // group) * ranks + k % ranks)

    schedule = []
    for r in range(ranks):
        warmup = interleaved_warmup(ranks, virtual_stages, microbatches, r)
        row = [action(r, k, F) for k in range(warmup)]
        for k in range(total - warmup):
            row += [action(r, k + warmup, F), action(r, k, B)]
        row += [action(r, k, B) for k in range(total - warmup, total)]
        schedule.append(row)
    return schedule


def interleaved_warmup(ranks: int, virtual_stages: int, microbatches: int, rank: int) -> int:
    """The forwards `interleaved_1f1b`'s rank `rank` runs before its first backward."""
    total = microbatches * virtual_stages
    return total if microbatches == ranks else min((ranks - rank - 1) * 2 + (virtual_stages - 1) * ranks, total)


def zb_h1(stages: int, microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al. 2024): 1F1B with B split in I and W, W's deferred (zero_bubble.py)."""
    _check_counts(stages, microbatches)
    return _actions(zero_bubble.zb_h1_order(stages, microbatches))


def zb_h2(stages: int, microbatches: int) -> Schedule:
    """ZB-H2 (Qi et al. 2024): twice ZB-H1's warm-up, no idle slot inside a rank's span (zero_bubble.py)."""
    _check_counts(stages, microbatches)
    return _actions(zero_bubble.zb_h2_order(stages, microbatches))


def zb_v(ranks: int, microbatches: int) -> Schedule:
    """ZB-V (Qi et al. 2024): 2 stages per rank in a V ([Note: V placement] in registry.py),
    W's in its gaps (zero_bubble.py)."""
    _check_counts(ranks, microbatches)
    return [[Action(r if chunk == 0 else 2 * ranks - 1 - r, Kind(kind), i) for kind, chunk, i in row]
            for r, row in enumerate(zero_bubble.zb_v_order(ranks, microbatches))]


def _actions(order: list[list[tuple[str, int]]]) -> Schedule:
    return [[Action(r, Kind(kind), i) for kind, i in row] for r, row in enumerate(order)]


def _check_counts(stages: int, microbatches: int) -> None:
    if stages < 1 or microbatches < 1:
        raise ScheduleError(f"a schedule needs at least one stage and one microbatch, got {stages} and {microbatches}.")
