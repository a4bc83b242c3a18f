"""Predict a training step's time from per-stage times.

For GPipe and 1F1B with stage times t_k (forward+backward of one microbatch) and M
microbatches, the step takes sum_k t_k + (M - 1) * max_k t_k: the first microbatch crosses
every stage, the other M - 1 are paced by the slowest (Huang et al., GPipe, 2019;
Narayanan et al., PipeDream-Flush/1F1B, 2021).  With equal stages that is
(M + S - 1) * t, whose bubble fraction is (S - 1) / (M + S - 1).  The interleaved
schedule (Narayanan et al., SC'21) divides the bubble by the virtual stages per rank v.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["step_time_s", "bubble_fraction"]


def step_time_s(stage_times: Sequence[float], microbatches: int, schedule: str, pp: int, virtual: int = 1) -> float:
    """Seconds for one step of `microbatches` microbatches."""
    if not stage_times:
        return 0.0
    if schedule == "interleaved" and virtual > 1:
        ranks = [sum(stage_times[s] for s in range(r, len(stage_times), pp)) for r in range(pp)]
        slowest = max(ranks)
        return microbatches * slowest + (pp - 1) * slowest / virtual
    return sum(stage_times) + (microbatches - 1) * max(stage_times)


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Idle fraction of a balanced GPipe/1F1B pipeline: (S - 1) / (M + S - 1)."""
    return (stages - 1) / (microbatches + stages - 1)
