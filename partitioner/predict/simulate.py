"""Predict a training step: an event simulation of the schedule IR with stage and link times.

The runtime's own lowered schedule (`runtime.schedule.lower(make_schedule(...))`: GPipe,
1F1B, interleaved 1F1B, the zero-bubble ones, with the SEND/RECV actions the runtime runs) is replayed action by
action, reading each action's kind, stage, microbatch and peer, with each stage's forward
and backward time per microbatch and the time of each point-to-point message, as
`runtime.DistributedPipeline` runs it on gloo (as torch.distributed.pipelining's
`_simulate_comms_compute` dry-runs its lowered order): every rank runs its actions in list
order; `lower` puts the receives right before the compute that needs them and the sends
right after the compute that made them, so it alone says which messages exist.  The model:

- compute: F or B of stage s takes forward_s[s] or backward_s[s]; the last stage's also
  takes the loss's forward or backward (`loss_s`);
- receive (rendezvous): gloo moves a message only once both sides have posted it, and
  the receiver waits in it, so a receive posted by r for a send posted by p ends at
  max(p, r) + links[(a, b)] (alpha + bytes * beta), not at p + message;
- send: posting one costs the sender `send_s` seconds on its own timeline (about the
  link's alpha), after the compute and before its next action;
- receive: posting one costs the receiver `recv_s` before it waits (each receive in turn,
  as the runtime posts one and waits in it before the next); with `ahead` (gloo: [Note:
  receives posted ahead] in runtime/schedule/lowering.py) the receives of a rank's next compute
  are posted, and cost `recv_s`, before its current compute, so their message moves
  during it: such a receive ends at max(its post, the send's post) + the message;
- end of step: after the last action of every rank, the loss all-reduce (`final_s`,
  about the all-reduce latency for a 0-dim tensor) runs on all ranks together, so the
  step is max over ranks of their last action's end, plus final_s.

On the CPU the three message costs are means measured under a loaded 1F1B exchange
(`partitioner.cost.measure._loaded_exchange`), stalls included: see [Note: messages on a busy CPU] there.

Stages on the same rank (interleaved, and zb-v's V: [Note: V placement] in
runtime/schedule/registry.py) hand values over for free.  The result is the step's
makespan, each rank's compute, and each stage's peak number of microbatches in flight
(forwards done whose backward has not run), which sets its activation memory.

Closed forms it agrees with (tests check them): with equal stages of time t and free
links (alpha = beta = 0, no send cost, no loss), GPipe and 1F1B take (M + S - 1) * t,
whose bubble is (S - 1) / (M + S - 1) (Huang et al., GPipe, 2019; Narayanan et al.,
PipeDream-Flush, 2021).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Mapping, Sequence

from runtime.schedule import Action, Kind, StageGraph, lower, make_schedule, placement, receives_ahead

__all__ = ["Simulation", "simulate", "bubble_fraction"]


@dataclass(frozen=True)
class Simulation:
    step_time_s: float
    busy_s: tuple[float, ...]  # compute per rank (the loss included)
    peak_inflight: tuple[int, ...]  # per stage
    events: tuple[tuple[int, float, float, str], ...] = ()  # (rank, start, end, action) of each compute


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
    weight_share: float | Sequence[float] = 0.5,
    ahead: bool = False,
) -> Simulation:
    """Simulate one step; `links[(a, b)]` (a < b) is the seconds of one message from stage
    a to stage b, which is also what its gradient takes back.  `send_s` and `recv_s` are
    what posting one send or receive costs the rank that posts it, `loss_s` the loss's
    (forward, backward) per microbatch on the last stage, `final_s` the collective that
    ends the step (the loss all-reduce).  Where the schedule splits B (zb-h1, zb-h2, zb-v), W
    takes `weight_share` of the stage's backward time (one for all stages, or one per
    stage: the profiled weight-gradient part, NodeCost.weight_fraction) and I the rest (the
    loss's backward with it); a microbatch's activations stay in flight until its W.
    `ahead`: receives are posted a compute ahead, as the runtime does on gloo."""
    stages = len(forward_s)
    graph = StageGraph(stages, pp, tuple(sorted(links)), frozenset(links),  # every edge carries a gradient back
                       placement(schedule, stages, pp))
    lowered, early = _lowered(schedule, pp, microbatches, virtual, graph, ahead)
    clock = _Clock(forward_s, backward_s, links, pp, send_s=send_s, recv_s=recv_s, loss_s=loss_s,
                   weight_share=weight_share)
    cursor = [0] * pp
    remaining = sum(len(actions) for actions in lowered)
    while remaining:
        progressed = False
        for rank, actions in enumerate(lowered):
            while cursor[rank] < len(actions):
                for j in early[rank].get(cursor[rank], ()):  # a compute, which runs now: first these
                    clock.post_receive(rank, actions[j])
                if not clock.run(rank, actions[cursor[rank]]):
                    break
                cursor[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError(f"the {schedule} schedule deadlocks in simulation")
    return Simulation(max(clock.free) + final_s, tuple(clock.busy), tuple(clock.peak), tuple(clock.events))


@functools.lru_cache(maxsize=32)
def _lowered(schedule: str, pp: int, microbatches: int, virtual: int, graph: StageGraph, ahead: bool
             ) -> tuple[tuple[tuple[Action, ...], ...], tuple[dict[int, tuple[int, ...]], ...]]:
    """Each rank's lowered actions and the receives it posts ahead, made once per schedule
    and stage graph (a search simulates hundreds of plans of a few shapes); read only."""
    lowered = tuple(tuple(row) for row in lower(make_schedule(schedule, pp, microbatches, virtual), graph))
    return lowered, tuple(receives_ahead(row) if ahead else {} for row in lowered)


class _Clock:
    """Each rank's time as it runs its lowered actions ([Note: schedule semantics] in
    runtime/schedule/validation.py): a compute takes its stage's time, a SEND posts the message at
    the sender's time (and costs it `send_s`), a RECV costs `recv_s`, waits for its
    SEND to be posted, then takes the message.  Values handed over on one rank are ready,
    as the rank's own order put their compute first."""

    def __init__(self, forward_s: Sequence[float], backward_s: Sequence[float], links: Mapping[tuple[int, int], float],
                 ranks: int, *, send_s: float, recv_s: float, loss_s: tuple[float, float],
                 weight_share: float | Sequence[float] = 0.5) -> None:
        stages = len(forward_s)
        self.forward_s, self.backward_s, self.links, self.last = forward_s, backward_s, links, stages - 1
        self.send_s, self.recv_s, self.loss_s = send_s, recv_s, loss_s
        self.weight_share = [weight_share] * stages if isinstance(weight_share, (int, float)) else list(weight_share)
        self.free, self.busy = [0.0] * ranks, [0.0] * ranks
        self.inflight, self.peak = [0] * stages, [0] * stages
        self.events: list[tuple[int, float, float, str]] = []  # what the timeline draws
        self.posted: dict[tuple[bool, int, int, int], float] = {}  # (backward, from, to, microbatch): posted at
        self.receiving: dict[Action, float] = {}  # receives posted ahead: when

    def post_receive(self, rank: int, a: Action) -> None:
        """Post the receive `a` now, ahead of the compute before it."""
        self.free[rank] += self.recv_s
        self.receiving[a] = self.free[rank]

    def run(self, rank: int, a: Action) -> bool:
        """Run `a` on `rank`; False (nothing done) when it is a RECV whose SEND is not posted yet."""
        if a.is_compute:
            self._compute(rank, a)
            return True
        assert a.peer is not None
        backward = a.kind.is_backward
        if a.kind.is_send:
            self.free[rank] += self.send_s
            self.posted[(backward, a.stage, a.peer, a.microbatch)] = self.free[rank]
            return True
        sent = self.posted.get((backward, a.peer, a.stage, a.microbatch))
        if sent is None:
            return False
        message = self.links[(min(a.stage, a.peer), max(a.stage, a.peer))]
        if a in self.receiving:  # posted ahead: its message moved meanwhile
            self.free[rank] = max(self.free[rank], max(self.receiving.pop(a), sent) + message)
        else:
            self.free[rank] = max(self.free[rank] + self.recv_s, sent) + message
        return True

    def _compute(self, rank: int, a: Action) -> None:
        forward = a.kind == Kind.F
        w = self.weight_share[a.stage]
        share = {Kind.F: 1.0, Kind.B: 1.0, Kind.I: 1.0 - w, Kind.W: w}[a.kind]
        own = share * (self.forward_s[a.stage] if forward else self.backward_s[a.stage])
        loss = self.loss_s[0 if forward else 1] if a.stage == self.last and a.kind != Kind.W else 0.0
        took = own + loss
        self.events.append((rank, self.free[rank], self.free[rank] + took, repr(a)))
        self.free[rank] += took
        self.busy[rank] += took
        self.inflight[a.stage] += 1 if forward else -1 if a.kind in (Kind.B, Kind.W) else 0
        self.peak[a.stage] = max(self.peak[a.stage], self.inflight[a.stage])


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Idle fraction of a balanced GPipe/1F1B pipeline: (S - 1) / (M + S - 1)."""
    return (stages - 1) / (microbatches + stages - 1)
