"""Predict a training step: an event simulation of the schedule IR with stage and link times.

The runtime's own schedule (`runtime.schedule.make_schedule`: GPipe, 1F1B, interleaved
1F1B) is replayed with each stage's forward and backward time per microbatch and the time
of each point-to-point message.  Every rank runs its actions in list order; an action
starts when its rank is free and its inputs have arrived (a producer's forward plus the
message time, or a consumer's backward plus the gradient's message time).  Sends are
asynchronous, so they cost the sender nothing and the receiver the transfer.  The result
is the step's makespan and each stage's peak number of microbatches in flight
(forwards done whose backward has not run), which sets its activation memory.

Closed forms it agrees with (tests check them): with equal stages of time t and free
links, GPipe and 1F1B take (M + S - 1) * t, whose bubble is (S - 1) / (M + S - 1)
(Huang et al., GPipe, 2019; Narayanan et al., PipeDream-Flush, 2021).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from runtime.schedule import make_schedule

__all__ = ["Simulation", "simulate", "bubble_fraction"]


@dataclass(frozen=True)
class Simulation:
    step_time_s: float
    busy_s: tuple[float, ...]  # compute per rank
    peak_inflight: tuple[int, ...]  # per stage


def simulate(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    links: Mapping[tuple[int, int], float],
    schedule: str,
    pp: int,
    microbatches: int,
    virtual: int = 1,
) -> Simulation:
    """Simulate one step; `links[(a, b)]` (a < b) is the seconds of one message from stage
    a to stage b, which is also what its gradient takes back."""
    stages = len(forward_s)
    plan = make_schedule(schedule, pp, microbatches, virtual)
    producers: dict[int, list[int]] = {s: [] for s in range(stages)}
    consumers: dict[int, list[int]] = {s: [] for s in range(stages)}
    for src, dst in links:
        producers[dst].append(src)
        consumers[src].append(dst)

    def message(a: int, b: int) -> float:
        """Seconds of a message between stages a and b (a gradient goes back the same link)."""
        return 0.0 if a % pp == b % pp else links[(min(a, b), max(a, b))]

    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * pp
    cursor = [0] * pp
    inflight = [0] * stages
    peak = [0] * stages
    busy = [0.0] * pp
    remaining = sum(len(actions) for actions in plan)
    while remaining:
        progressed = False
        for rank, actions in enumerate(plan):
            while cursor[rank] < len(actions):
                a = actions[cursor[rank]]
                ready = _ready(a.kind, a.stage, a.microbatch, done, producers, consumers, message)
                if ready is None:
                    break
                duration = forward_s[a.stage] if a.kind == "F" else backward_s[a.stage]
                start = max(free[rank], ready)
                free[rank] = done[(a.kind, a.stage, a.microbatch)] = start + duration
                busy[rank] += duration
                inflight[a.stage] += 1 if a.kind == "F" else -1
                peak[a.stage] = max(peak[a.stage], inflight[a.stage])
                cursor[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError(f"the {schedule} schedule deadlocks in simulation")
    return Simulation(max(free), tuple(busy), tuple(peak))


def _ready(kind: str, stage: int, mb: int, done: dict[tuple[str, int, int], float],
           producers: dict[int, list[int]], consumers: dict[int, list[int]],
           message: Callable[[int, int], float]) -> float | None:
    """When an action's inputs are all there, or None if some have not been produced."""
    if kind == "F":
        needs = [(("F", p, mb), message(p, stage)) for p in producers[stage]]
    else:
        needs = [(("F", stage, mb), 0.0)] + [(("B", c, mb), message(c, stage)) for c in consumers[stage]]
    times = []
    for key, delay in needs:
        if key not in done:
            return None
        times.append(done[key] + delay)
    return max(times, default=0.0)


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Idle fraction of a balanced GPipe/1F1B pipeline: (S - 1) / (M + S - 1)."""
    return (stages - 1) / (microbatches + stages - 1)
