"""Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): one stage per rank.

The backward of each microbatch is split in two actions ([Note: split backward] in
stage.py): I, the gradients of the stage's inputs (what the previous stage waits for),
and W, the gradients of its weights (which nobody waits for).  Running I as soon as its
gradient arrives and W later shortens the chain of dependencies that makes 1F1B's
bubble, and W fills the idle slots.  With S ranks, M microbatches and unit times
F = I = W, a step takes (one action per cell; `validate` draws these grids):

    1F1B    3 (M + S - 1)      bubble 3 (S - 1) per rank, peak S microbatches in flight
    ZB-H1   3 M + (S - 1)      bubble (S - 1): a third, the same peak S (paper, section 3.1)
    ZB-H2   3 M + (S - 1)      no idle slot between a rank's first and last action,
                               peak 2 S (twice H1's).  With I = 2 and F = W = 1 it still
                               takes the bound 4 M + (S - 1) where H1 takes 4 M + 2 (S - 1)

[Note: zero-bubble orders]
    zb_h1, rank r: 1F1B's S-1-r warm-up forwards, then F and I alternate as F and B do
    in 1F1B; the first r W's are held back (so every rank holds at most S microbatches,
    1F1B's peak on rank 0), then each I is followed by the oldest W left; the held-back
    W's close the row, in the slots where 1F1B's cool-down waits.
    zb_h2, rank r: 2(S-r)-1 warm-up forwards (enough that rank 0 never waits for its
    first gradient), then I, the next F while any is left, and a W held back by 2r
    microbatches, the 2r + 1 last W's closing the row: each rank is busy from its first
    action to its last (a parallelogram; the ramp S - 1 is the step's only idle time).
    (The orders are plain (kind, microbatch) pairs: schedule.py turns them into its
    Actions, so this module imports nothing.)  Both orders are simulated in
    tests/partitioner/test_simulate.py against these closed forms.
"""

from __future__ import annotations

__all__ = ["Order", "zb_h1_order", "zb_h2_order"]

Order = list[list[tuple[str, int]]]  # per rank: (kind "F" | "I" | "W", microbatch); schedule.py makes Actions


def zb_h1_order(stages: int, microbatches: int) -> Order:
    """ZB-H1: 1F1B's order with each B split in I and W and W's deferred ([Note: zero-bubble orders])."""
    rows = []
    for r in range(stages):
        warmup = min(stages - 1 - r, microbatches)
        row: list[tuple[str, int]] = [("F", i) for i in range(warmup)]
        weights = 0
        for j in range(microbatches):
            if warmup + j < microbatches:
                row.append(("F", warmup + j))
            row.append(("I", j))
            if j >= r:
                row.append(("W", weights))
                weights += 1
        row += [("W", i) for i in range(weights, microbatches)]
        rows.append(row)
    return rows


def zb_h2_order(stages: int, microbatches: int) -> Order:
    """ZB-H2: twice H1's warm-up forwards, W's held back by 2r ([Note: zero-bubble orders])."""
    rows = []
    for r in range(stages):
        forwards = min(2 * (stages - r) - 1, microbatches)
        row: list[tuple[str, int]] = [("F", i) for i in range(forwards)]
        weights = 0
        for j in range(microbatches):
            row.append(("I", j))
            if forwards < microbatches:
                row.append(("F", forwards))
                forwards += 1
            if j >= 2 * r:
                row.append(("W", weights))
                weights += 1
        row += [("W", i) for i in range(weights, microbatches)]
        rows.append(row)
    return rows
