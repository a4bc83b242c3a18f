"""Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): ZB-H1 and ZB-H2 on
one stage per rank, ZB-V on two stages per rank placed in a V.

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

and ZB-V, on p ranks of two stages each (2p stages of half a rank's work: unit F = I = W
per stage, a rank's whole work 6 per microbatch, as ZB-H1's 3 on stages twice as long):

    ZB-V    6 M + (p - 1)      for M >= 2p - 1; each rank peaks at 2p stage-microbatches,
                               p whole ranks' worth: 1F1B's first-rank peak

[Note: zero-bubble orders]
    zb_h1, rank r: 1F1B's S-1-r warm-up forwards, then F and I alternate as F and B do
    in 1F1B; the first r W's are held back (so every rank holds at most S microbatches,
    1F1B's peak on rank 0), then each I is followed by the oldest W left; the held-back
    W's close the row, in the slots where 1F1B's cool-down waits.
    zb_h2, rank r: 2(S-r)-1 warm-up forwards (enough that rank 0 never waits for its
    first gradient), then I, the next F while any is left, and a W held back by 2r
    microbatches, the 2r + 1 last W's closing the row: each rank is busy from its first
    action to its last (a parallelogram; the ramp S - 1 is the step's only idle time).
    zb_v, rank r holding chunk 0 (stage r) and chunk 1 (stage 2p-1-r, [Note: V placement]
    in schedule/registry.py): the forward goes down the ranks in chunk 0 and back up in chunk 1, so
    microbatch 0 reaches rank r's chunk 1 at step 2p-1-r and its gradient comes back there
    at 2p+r.  The row fills exactly those gaps:
      1. 2(p-r)-1 forwards of chunk 0, until chunk 1's first input arrives;
      2. r pairs (F of chunk 1, F of chunk 0), until its first gradient arrives;
      3. p-r triples (F, I, W) of chunk 1: W takes the slot where the next gradient is
         still on its way (the rank now holds 2p stage-microbatches, its peak);
      4. steady state: F, I, W of chunk 0 then of chunk 1 (each F paid for by a W);
      5. cool-down: r pairs (I of chunk 0, I of chunk 1), then p-r pairs (I, W) of
         chunk 0, then the W's left, chunk 1's first.
    With fewer than 2p - 1 microbatches the same row skips what does not exist.  Every
    stage k then holds at most min(2p - k, M) microbatches, 1F1B's count on 2p stages.
    (The orders are plain (kind, microbatch) pairs, or (kind, chunk, microbatch) for
    zb_v: schedule/builders.py turns them into its Actions, so this module imports nothing.)
    The orders are simulated in tests/partitioner/test_simulate.py against these
    closed forms.
"""

from __future__ import annotations

__all__ = ["Order", "VOrder", "zb_h1_order", "zb_h2_order", "zb_v_order"]

Order = list[list[tuple[str, int]]]  # per rank: (kind "F" | "I" | "W", microbatch); schedule/builders.py makes Actions
VOrder = list[list[tuple[str, int, int]]]  # per rank: (kind, chunk 0 | 1, microbatch)


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


def zb_v_order(ranks: int, microbatches: int) -> VOrder:
    """ZB-V: two chunks per rank in a V, W's in the gaps of the V ([Note: zero-bubble orders])."""
    return [_v_row(ranks, r, microbatches) for r in range(ranks)]


def _v_row(p: int, r: int, microbatches: int) -> list[tuple[str, int, int]]:
    row: list[tuple[str, int, int]] = []
    done = {(kind, chunk): 0 for kind in "FIW" for chunk in (0, 1)}

    def run(*actions: tuple[str, int]) -> None:
        """Append each (kind, chunk) on its next microbatch, where there is one."""
        for kind, chunk in actions:
            if done[(kind, chunk)] < microbatches:
                row.append((kind, chunk, done[(kind, chunk)]))
                done[(kind, chunk)] += 1

    def left(kind: str, chunk: int) -> bool:
        return done[(kind, chunk)] < microbatches

    run(*[("F", 0)] * (2 * (p - r) - 1))
    run(*[("F", 1), ("F", 0)] * r)
    run(*[("F", 1), ("I", 1), ("W", 1)] * (p - r))
    while left("F", 0) or left("F", 1):
        run(("F", 0), ("I", 0), ("W", 0), ("F", 1), ("I", 1), ("W", 1))
    run(*[("I", 0), ("I", 1)] * r)
    run(*[("I", 0), ("W", 0)] * (p - r))
    for chunk in (1, 0):
        while left("I", chunk) or left("W", chunk):
            run(("I", chunk), ("W", chunk))
    return row
