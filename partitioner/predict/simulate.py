"""Predict a training step: an event simulation of the schedule IR with stage and link times.

The runtime's own schedule (`runtime.schedule.make_schedule`: GPipe, 1F1B, interleaved
1F1B) is replayed with each stage's forward and backward time per microbatch and the time
of each point-to-point message, as `runtime.DistributedPipeline` runs it on gloo: every
rank runs its actions in list order, receives posted right before the compute that needs
them and sends posted right after the compute that made them.  The model:

- compute: F or B of stage s takes forward_s[s] or backward_s[s]; the last stage's also
  takes the loss's forward or backward (`loss_s`);
- receive (rendezvous): gloo moves a message only once both sides have posted it, and
  the receiver waits in it, so a receive posted by r for a send posted by p ends at
  max(p, r) + links[(a, b)] (alpha + bytes * beta), not at p + message;
- send: posting one costs the sender `send_s` seconds on its own timeline (about the
  link's alpha), after the compute and before its next action;
- receive: posting one costs the receiver `recv_s` before it waits;
- end of step: after the last action of every rank, the loss all-reduce (`final_s`,
  about the all-reduce latency for a 0-dim tensor) runs on all ranks together, so the
  step is max over ranks of their last action's end, plus final_s.

On the CPU the three message costs are means measured under a loaded 1F1B exchange
(`hardware._loaded_exchange`), stalls included: see [Note: messages on a busy CPU] there.

Stages on the same rank (interleaved) hand values over for free.  The result is the step's
makespan, each rank's compute, and each stage's peak number of microbatches in flight
(forwards done whose backward has not run), which sets its activation memory.

Closed forms it agrees with (tests check them): with equal stages of time t and free
links (alpha = beta = 0, no send cost, no loss), GPipe and 1F1B take (M + S - 1) * t,
whose bubble is (S - 1) / (M + S - 1) (Huang et al., GPipe, 2019; Narayanan et al.,
PipeDream-Flush, 2021).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from runtime.schedule import make_schedule

__all__ = ["Simulation", "simulate", "bubble_fraction"]


@dataclass(frozen=True)
class Simulation:
    step_time_s: float
    busy_s: tuple[float, ...]  # compute per rank (the loss included)
    peak_inflight: tuple[int, ...]  # per stage


def simulate(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    links: Mapping[tuple[int, int], float],
    schedule: str,
    pp: int,
    microbatches: int,
    virtual: int = 1,
    *,
    send_s: float = 0.0,
    loss_s: tuple[float, float] = (0.0, 0.0),
    recv_s: float = 0.0,
    final_s: float = 0.0,
) -> Simulation:
    """Simulate one step; `links[(a, b)]` (a < b) is the seconds of one message from stage
    a to stage b, which is also what its gradient takes back.  `send_s` and `recv_s` are
    what posting one send or receive costs the rank that posts it, `loss_s` the loss's
    (forward, backward) per microbatch on the last stage, `final_s` the collective that
    ends the step (the loss all-reduce)."""
    stages = len(forward_s)
    last = stages - 1
    plan = make_schedule(schedule, pp, microbatches, virtual)
    producers: dict[int, list[int]] = {s: [] for s in range(stages)}
    consumers: dict[int, list[int]] = {s: [] for s in range(stages)}
    for src, dst in links:
        producers[dst].append(src)
        consumers[src].append(dst)

    def duration(kind: str, stage: int) -> float:
        own = forward_s[stage] if kind == "F" else backward_s[stage]
        return own + (loss_s[0 if kind == "F" else 1] if stage == last else 0.0)

    done: dict[tuple[Any, ...], float] = {}  # (kind, stage, mb): compute end
    posted: dict[tuple[Any, ...], float] = {}  # (kind, stage, mb, peer): send posted

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
                # what this action waits for: (key of a local result or of a posted send, message)
                if a.kind == "F":
                    needs = [(("F", p, a.microbatch), p, links[(p, a.stage)]) for p in producers[a.stage]]
                    peers = consumers[a.stage]
                else:
                    needs = [(("F", a.stage, a.microbatch), a.stage, 0.0)]
                    needs += [(("B", c, a.microbatch), c, links[(a.stage, c)]) for c in consumers[a.stage]]
                    peers = producers[a.stage]
                local = [(done, key, 0.0) if peer % pp == rank else (posted, key + (a.stage,), message)
                         for key, peer, message in needs]
                if any(key not in table for table, key, _ in local):
                    break
                t = free[rank] + recv_s * sum(table is posted for table, _, _ in local)
                for table, key, message in local:
                    # a local value is there when made; a receive, posted by t, waits for
                    # the send to be posted and then takes the message
                    t = max(t, table[key]) + message
                t += duration(a.kind, a.stage)
                busy[rank] += duration(a.kind, a.stage)
                done[(a.kind, a.stage, a.microbatch)] = t
                for peer in peers:
                    if peer % pp != rank:
                        t += send_s
                        posted[(a.kind, a.stage, a.microbatch, peer)] = t
                free[rank] = t
                inflight[a.stage] += 1 if a.kind == "F" else -1
                peak[a.stage] = max(peak[a.stage], inflight[a.stage])
                cursor[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError(f"the {schedule} schedule deadlocks in simulation")
    return Simulation(max(free) + final_s, tuple(busy), tuple(peak))


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Idle fraction of a balanced GPipe/1F1B pipeline: (S - 1) / (M + S - 1)."""
    return (stages - 1) / (microbatches + stages - 1)
