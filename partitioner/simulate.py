"""Predict a training step: an event simulation of the schedule IR with stage and link times.

The runtime's own schedule (`runtime.schedule.make_schedule`: GPipe, 1F1B, interleaved
1F1B) is replayed with each stage's forward and backward time per microbatch and the time
of each point-to-point message, as `runtime.DistributedPipeline` runs it on gloo: every
rank runs its actions in list order, receives posted right before the compute that needs
them and sends posted right after the compute that made them.  The model:

- compute: F or B of stage s takes forward_s[s] or backward_s[s]; the last stage's also
  takes the loss's forward or backward (`loss_s`);
- receive (rendezvous): gloo moves a message only once both sides have posted it, and
  the receiver waits in it, so a receive posted at r for a send posted at p ends at
  max(p, r) + links[(a, b)] (alpha + bytes * beta), not at p + message;
- send: posting one costs the sender `send_s` seconds on its own timeline (about the
  link's alpha), after the compute and before its next action;
- end of step: after the last action of every rank, the loss all-reduce (`final_s`,
  about the all-reduce latency for a 0-dim tensor) runs on all ranks together, so the
  step is max over ranks of their last action's end, plus final_s.

[Note: messages on a busy CPU]
    With gloo on a CPU whose cores the ranks' compute fills (2 ranks, 2 cores), a message
    does not move while its sender computes: gloo's own thread gets a core only when the
    sender's main thread blocks.  Traces show it (a receive ends right after its sender
    posts its next receive, not after alpha + n beta).  With `moves_when_waiting` a
    message is released when its sender next posts a receive, or ends its step, and the
    receiver takes it from then on; profiles whose collectives overlap compute (NCCL on
    GPUs: `overlaps_comm`) keep the plain model.

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
    final_s: float = 0.0,
    moves_when_waiting: bool = False,
) -> Simulation:
    """Simulate one step; `links[(a, b)]` (a < b) is the seconds of one message from stage
    a to stage b, which is also what its gradient takes back.  `send_s` is what posting one
    send costs its sender, `loss_s` the loss's (forward, backward) per microbatch on the
    last stage, `final_s` the collective that ends the step (the loss all-reduce).
    `moves_when_waiting`: a message leaves its sender only once the sender waits (posts its
    next receive, or ends its step), see [Note: messages on a busy CPU]."""
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
    released: dict[tuple[Any, ...], float] = {}  # the same key: when the message may move
    pending: list[list[tuple[Any, ...]]] = [[] for _ in range(pp)]  # sends not yet released

    def release(rank: int) -> None:
        for key in pending[rank]:
            released[key] = free[rank]
        pending[rank].clear()

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
                local = [(done, key, 0.0) if peer % pp == rank else (released, key + (a.stage,), message)
                         for key, peer, message in needs]
                if any(peer % pp != rank for _, peer, _ in needs):
                    release(rank)  # it posts a receive and waits: its own sends may move
                if any(key not in table for table, key, _ in local):
                    break
                t = free[rank]
                for table, key, message in local:
                    # a local value is there when made; a receive, posted at t, waits for
                    # the send (and its release) and then takes the message
                    t = max(t, table[key]) + message
                t += duration(a.kind, a.stage)
                busy[rank] += duration(a.kind, a.stage)
                done[(a.kind, a.stage, a.microbatch)] = t
                for peer in peers:
                    if peer % pp != rank:
                        key = (a.kind, a.stage, a.microbatch, peer)
                        posted[key] = t
                        if moves_when_waiting:
                            pending[rank].append(key)
                        else:
                            released[key] = t
                        t += send_s
                free[rank] = t
                inflight[a.stage] += 1 if a.kind == "F" else -1
                peak[a.stage] = max(peak[a.stage], inflight[a.stage])
                cursor[rank] += 1
                remaining -= 1
                progressed = True
            if cursor[rank] == len(actions):
                release(rank)  # the step's end: it waits in the loss all-reduce
        if not progressed:
            raise ValueError(f"the {schedule} schedule deadlocks in simulation")
    return Simulation(max(free) + final_s, tuple(busy), tuple(peak))


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Idle fraction of a balanced GPipe/1F1B pipeline: (S - 1) / (M + S - 1)."""
    return (stages - 1) / (microbatches + stages - 1)
