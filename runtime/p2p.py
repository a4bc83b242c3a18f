"""Point-to-point hand-overs between pipeline ranks: the SEND_F / SEND_B and RECV_F / RECV_B
actions of a `DistributedPipeline` rank (its steps 2 and 7).

    send     the edge's values (shape, dtype from the manifest, checked; tp rank t sends
             its own local tensors to tp rank t) isent as one message (messages.py); on
             CUDA from the communication stream ([Note: communication stream] in devices.py)
    post     irecv into a fresh buffer of the size the manifest gives (on gloo before the
             previous compute: [Note: receives posted ahead] in schedule/lowering.py)
    wait     the receive, with the timeout; the message's values, one per spec
    sends    waited on at the end of the step

What an edge carries (`edges.Edge`) is made once per package, each shape once per
microbatch size; no shape travels with a message.  Tags: [Note: step numbers] in steps.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from . import messages
from .comm import guard, wait
from .devices import CommStream
from .edges import Edge, Edges
from .errors import PipelineError
from .manifest import StageOutput
from .schedule import Action, Kind
from .steps import StepGuard

__all__ = ["HandOvers", "Receive", "Sent"]


@dataclass(frozen=True)
class Receive:
    """A posted receive: its work, its buffer, and the edge (and shapes) the buffer holds."""

    work: Any
    buffer: torch.Tensor
    edge: Edge
    shapes: list[list[int]]


@dataclass(frozen=True)
class Sent:
    """A posted send, and its message, kept alive until it is waited on
    ([Note: communication stream] rule 2 in devices.py)."""

    work: Any
    action: Action
    message: torch.Tensor


class HandOvers:
    """This rank's point-to-point messages: to and from the ranks of the same replica and
    tensor-parallel index that hold the other stages."""

    def __init__(self, edges: Edges, groups: Mapping[tuple[int, int], Any], ranks: Sequence[int], rank: int,
                 comm: CommStream, device: torch.device, steps: StepGuard, timeout_s: float) -> None:
        self.edges, self.groups, self.ranks, self.rank = edges, groups, ranks, rank
        self.comm, self.device, self.steps, self.timeout_s = comm, device, steps, timeout_s

    def edge(self, a: Action) -> Edge:
        """What the hand-over of `a` carries: edge p -> c's values forward, their grads back."""
        assert a.peer is not None
        p, c = (a.stage, a.peer) if a.kind in (Kind.SEND_F, Kind.RECV_B) else (a.peer, a.stage)
        return self.edges.get(p, c, a.kind in (Kind.SEND_F, Kind.RECV_F))

    def send(self, a: Action, values: list[torch.Tensor | None], rows: int) -> Sent | None:
        """Post the send of `a`: `values` in the edge's order (None: a gradient that did not
        flow, sent as zeros); None when the edge carries nothing."""
        edge = self.edge(a)
        tensors = [self._checked(a, spec, value, shape, dtype)
                   for spec, value, shape, dtype in zip(edge.specs, values, edge.shapes(rows), edge.dtypes)]
        if not tensors:
            return None  # no gradient flows back on this edge
        message = tensors[0] if len(tensors) == 1 else messages.pack(tensors)  # [Note: one message per hand-over]
        with guard(self.doing(a)), self.comm.sending():
            work = dist.isend(message, dst=self._peer(a), group=self._group(a), tag=self.tag(a.microbatch, a.kind == Kind.SEND_F))
        return Sent(work, a, message)

    def post(self, a: Action, rows: int) -> Receive | None:
        """Post the receive of `a` into a fresh buffer (None: nothing flows on its edge)."""
        edge = self.edge(a)
        if not edge.specs:
            return None
        shapes = edge.shapes(rows)
        if len(shapes) == 1:
            buffer = self.comm.empty(shapes[0], edge.dtypes[0])
        else:  # the edge's values packed in one message (messages.py)
            buffer = self.comm.empty([edge.message_bytes(rows)], torch.uint8)
        with self.comm.posting(), guard(self.doing(a)):
            work = dist.irecv(buffer, src=self._peer(a), group=self._group(a), tag=self.tag(a.microbatch, a.kind == Kind.RECV_F))
        return Receive(work, buffer, edge, shapes)

    def wait(self, a: Action, got: Receive) -> list[tuple[StageOutput, torch.Tensor]]:
        """Wait for the receive of `a`; its values, each with its spec."""
        with self.comm.receiving(got.buffer):
            wait(got.work, self.timeout_s, self.doing(a))
        values = [got.buffer] if len(got.shapes) == 1 else messages.unpack(got.buffer, got.shapes, got.edge.dtypes)
        return list(zip(got.edge.specs, values))

    def wait_sends(self, sends: list[Sent]) -> None:
        """Wait for every send posted (step 7)."""
        for sent in sends:
            wait(sent.work, self.timeout_s, self.doing(sent.action))

    def tag(self, microbatch: int, forward: bool) -> int:
        """The step (mod 2^12), the microbatch and the direction: [Note: step numbers] in steps.py."""
        return ((self.steps.call % 4096) * self.edges.manifest.microbatches + microbatch) * 2 + (0 if forward else 1)

    def doing(self, a: Action) -> Callable[[bool, str], str]:
        """The words for a failed or silent hand-over `a`: this rank, the peer, the fix."""
        peer = self.ranks[a.peer] if a.peer is not None else -1
        direction = "from" if a.kind.startswith("RECV") else "to"
        rank, timeout_s = self.rank, self.timeout_s

        def say(timed_out: bool, reason: str) -> str:
            return (f"rank {rank} (stage {a.stage}) {'timed out' if timed_out else 'failed'} in {a.kind} "
                    f"{direction} stage {a.peer}, microbatch {a.microbatch}: rank {peer} stopped or failed "
                    f"({reason}). Look at rank {peer}'s own error; if it is only slow, raise PIPELINE_TIMEOUT_S "
                    f"(now {timeout_s:g} s).")
        return say

    def _checked(self, a: Action, spec: StageOutput, value: torch.Tensor | None, shape: list[int],
                 dtype: torch.dtype) -> torch.Tensor:
        """`value` (zeros for a missing gradient), contiguous, with the manifest's shape and dtype."""
        tensor = value if value is not None else torch.zeros(shape, dtype=dtype, device=self.device)
        if list(tensor.shape) != shape or tensor.dtype != dtype:
            raise PipelineError(f"stage {a.stage} sends {spec.name!r} of microbatch {a.microbatch} with shape "
                                f"{list(tensor.shape)} {tensor.dtype} but the manifest says {shape} "
                                f"{spec.dtype}: compile the model again (the runtime sends no shapes).")
        return tensor.contiguous()

    def _peer(self, a: Action) -> int:
        assert a.peer is not None
        return self.ranks[a.peer]

    def _group(self, a: Action) -> Any:
        """The process group of `a`'s edge (producer, consumer)."""
        assert a.peer is not None
        forward_edge = a.kind in (Kind.SEND_F, Kind.RECV_B)
        return self.groups[(a.stage, a.peer) if forward_edge else (a.peer, a.stage)]
