"""Lowering: a compute-only schedule plus the stage graph gives every rank's SEND/RECV.

[Note: receives posted ahead]
    `lower` puts each receive right before the compute that needs it, which is where a
    rank WAITS for it.  Where the transport lets a receive be posted early (gloo), the
    runtime posts the receives of a rank's next compute before it starts the current one
    (`receives_ahead`): gloo moves a message only once both sides have posted it, so a
    receive posted just in time costs its rank the whole round trip (about a millisecond
    on a 2-core CPU machine's loopback, as much as a small stage's compute), while one posted a compute
    ahead arrives during that compute.  The order of the actions, and so every schedule's
    validity, is unchanged: only the posting moves.  The simulator posts them where the
    runtime does (partitioner/predict/simulate.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ..errors import ScheduleError
from .actions import F, RECV_B, RECV_F, SEND_B, SEND_F, W, Action, Schedule
from .graph import StageGraph, as_graph

if TYPE_CHECKING:
    from ..manifest import Manifest

__all__ = ["lower", "receives_ahead"]


def lower(schedule: Schedule, graph: "StageGraph | Manifest | Mapping[str, Any]") -> Schedule:
    """Add the SEND/RECV actions: receives right before the compute that needs them,
    sends right after the compute that produced them (one per peer stage on another rank)."""
    g = as_graph(graph)
    lowered = []
    for r, row in enumerate(schedule):
        out: list[Action] = []
        for a in row:
            s, i = a.stage, a.microbatch
            if a.kind == F:
                out += [Action(s, RECV_F, i, p) for p in g.producers(s) if g.rank_of(p) != r]
                out.append(a)
                out += [Action(s, SEND_F, i, c) for c in g.consumers(s) if g.rank_of(c) != r]
            elif a.kind == W:
                out.append(a)  # no message: W only needs this stage's own I
            elif a.kind.sends_grads:
                out += [Action(s, RECV_B, i, c) for c in g.consumers(s) if g.rank_of(c) != r and (s, c) in g.grad_edges]
                out.append(a)
                out += [Action(s, SEND_B, i, p) for p in g.producers(s) if g.rank_of(p) != r and (p, s) in g.grad_edges]
            else:
                raise ScheduleError(f"lower() takes a compute-only schedule but rank {r} already has {a!r}.")
        lowered.append(out)
    return lowered


def receives_ahead(row: Sequence[Action]) -> dict[int, tuple[int, ...]]:
    """For each compute action of a lowered `row`, by index, the indices of the receives
    of the rank's next compute (those between the two): what the runtime posts before
    running it ([Note: receives posted ahead])."""
    ahead: dict[int, tuple[int, ...]] = {}
    computes = [t for t, a in enumerate(row) if a.is_compute]
    for t, nxt in zip(computes, computes[1:]):
        recvs = tuple(j for j in range(t + 1, nxt) if row[j].kind in (RECV_F, RECV_B))
        if recvs:
            ahead[t] = recvs
    return ahead
