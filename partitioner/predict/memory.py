"""Each pipeline rank's peak bytes in one training step, walked over its schedule.

[Note: the memory walk]
    A rank's peak is found by walking its row of the schedule's own compute actions
    (`runtime.schedule.registry`: the same list the runtime runs, so gpipe, 1F1B,
    interleaved and the zero-bubble orders each keep in flight what they really do, on
    each rank).  At every action the rank holds:

    - its parameters and optimizer state (alive across steps; Adam's moments made by the
      first step; 1/dp of them with ZeRO-1), once per rank where its stages share a
      tied weight;
    - its gradients, from the first backward of each stage on (`optimizer.zero_grad()`
      sets them to None between steps, so none is alive during gpipe's forwards);
    - per microbatch in flight on each stage (forward done, backward not yet: W for the
      split backward of zb-*), what the stage keeps for it: the tensors autograd saved
      (only the stage's inputs under --recompute full; those and the kept ops' outputs
      under selective; with --offload the offloaded share lives on the host: where the
      copies run beside the compute (a GPU profile), of the microbatches beyond the two
      resident; where they are done inside it (the CPU), of every microbatch but those
      brought back, from the runtime's `prefetches` or the action that reads them to the
      end of its backward or I), the inputs
      it received or took from the batch, the outputs it sent, and on the last stage the
      loss's own saved tensors;
    - per microbatch, what a stage passes in memory to another stage of the same rank (a
      V's two stages under zb-v): the storages of those values, from its forward to the
      end of its backward (the taking stage does not count them again: [Note: saved
      bytes per stage] in cost/saved.py), and their gradients, from the taking stage's
      backward to the end of the passing one's;
    - between a split backward's I and its W, the gradients I keeps for W at each
      node that reads a weight ([Note: weight-gradient seeds] in
      runtime/split_backward.py): the outputs' size of those nodes;
    - the transient of the action: a forward's working set (its largest node output);
      a backward's output gradient received, its input gradient made, the gradients'
      first allocation beyond the activations it frees meanwhile (made node by node
      as the saved tensors go), and the gradient flowing through the stage, counted
      as its largest node output; under
      --recompute the backward's second forward, at whose end every node output of the
      stage is alive (the generated forward keeps each in a local until it returns),
      or, where more, what the policy did not keep of one microbatch's activations with
      the flowing gradient; on the last stage the loss's logits gradient.

    The optimizer's step runs after the last action, with every gradient alive; its
    temporaries are those of one parameter at a time (torch's per-parameter loop on the
    CPU) and are counted as the largest parameter twice.  Not predicted: the memory an
    operator uses inside itself, the allocator's fragmentation and caching on a GPU, and
    what the loss function allocates beyond what it saves (see docs/memory.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Sequence

from runtime.offload import prefetches
from runtime.schedule.actions import Action, Kind
from runtime.schedule.registry import schedule_spec

from ..ir import OFFLOAD_RESIDENT

__all__ = ["StageBytes", "rank_peaks", "stage_shares"]


@dataclass(frozen=True)
class StageBytes:
    """What one stage holds, in bytes ([Note: the memory walk]): `persistent` (parameters
    and optimizer state), `gradients`, per microbatch in flight `held`, and the transient
    of its backward (`backward`: output and input gradients, the second forward).  A
    weight that an earlier stage of the same rank holds too (tied) is left out of the
    later stage's `persistent` and `gradients`: the rank holds it once."""

    persistent: int
    gradients: int
    held: int
    backward: int
    seeds: int = 0  # kept from a split backward's I to its W: [Note: weight-gradient seeds]
    forward: int = 0  # the working set of a forward beyond what it keeps
    #: whether I computes anything: the first stage, none of whose inputs needs a
    #: gradient, has I do nothing and W run the whole backward ([Note: split backward])
    splits: bool = True
    sent_forward: int = 0  # what a forward sends, kept until the step waits on its sends
    sent_backward: int = 0  # what a backward (I) sends back, likewise
    ahead: int = 0  # receive buffers posted ahead of the action that needs them
    #: of `held`, what lives on the host for each microbatch in flight beyond the
    #: `OFFLOAD_RESIDENT` on the device ([Note: offloaded activations] in solve/offload.py)
    offloaded: int = 0
    #: per microbatch, the storages it passes in memory to stages of its own rank, kept from
    #: its forward to the end of its backward ([Note: saved bytes per stage] in cost/saved.py)
    passed: int = 0
    passed_grads: int = 0  # their gradients, from the taking stage's backward to this one's
    taken_grads: int = 0  # the gradients its backward makes of what it takes so


def rank_peaks(schedule: str, pp: int, microbatches: int, virtual_stages: int,
               stages: Sequence[StageBytes], step_transient: int = 0, ahead: int | None = None) -> tuple[int, ...]:
    """The peak bytes of each pipeline rank over one step and its optimizer step; `ahead`:
    offloading's copies done inside the compute, brought back that many compute actions
    ahead (None: copies beside the compute, [Note: offloaded activations])."""
    rows = _rows(schedule, pp, microbatches, virtual_stages)
    return tuple(_walk(row, stages, step_transient, ahead) for row in rows)


@functools.lru_cache(maxsize=64)
def _rows(schedule: str, pp: int, microbatches: int, virtual_stages: int) -> tuple[tuple[Action, ...], ...]:
    """The schedule's compute rows, made once per shape (the search walks hundreds of plans)."""
    return tuple(tuple(row) for row in schedule_spec(schedule).make(pp, microbatches, virtual_stages))


@dataclass
class _Copies:
    """Which in-flight microbatches of offloading stages have their offloaded bytes on the
    device at each action of a row, where the copies are done inside the compute (`ahead`
    given): brought back as the runtime's `prefetches` says, or by the action that reads
    them, and gone after its backward (or its I, until W brings them back)."""

    stages: Sequence[StageBytes]
    back: dict[int, list[Action]]
    done: set[tuple[int, int]] = field(default_factory=set)  # forwards run
    loaded: set[tuple[int, int]] = field(default_factory=set)

    def load(self, k: int, m: int) -> int:
        """Bring microbatch `m` of stage `k` back (if offloaded and not yet): the bytes added."""
        if (k, m) not in self.done or (k, m) in self.loaded or not self.stages[k].offloaded:
            return 0
        self.loaded.add((k, m))
        return self.stages[k].offloaded

    def before(self, t: int) -> int:
        """The bytes brought back before action `t`."""
        return sum(self.load(a.stage, a.microbatch) for a in self.back.get(t, ()))

    def drop(self, k: int, m: int) -> int:
        """After a backward or I: the bytes of `m`'s copy that go (as a negative)."""
        if (k, m) not in self.loaded:
            return 0
        self.loaded.discard((k, m))
        return -self.stages[k].offloaded


def _walk(row: Sequence[Action], stages: Sequence[StageBytes], step_transient: int, ahead: int | None) -> int:
    """One rank's peak: its row of compute actions walked in order."""
    mine = sorted({a.stage for a in row})
    base = sum(stages[k].persistent + stages[k].ahead for k in mine)
    held = {k: 0 for k in mine}
    grads: set[int] = set()
    kept = 0  # gradients, activations in flight and seeds, kept as they change (`now` below)
    peak = base
    copies = _Copies(stages, prefetches(row, ahead)) if ahead is not None else None
    resident = OFFLOAD_RESIDENT if copies is None else 0
    for t, a in enumerate(row):
        k = a.stage
        if copies is not None:
            kept += copies.before(t) + (copies.load(k, a.microbatch) if a.kind != Kind.F else 0)
        now = base + kept
        if a.kind == Kind.F:
            kept += _holding(stages[k], held[k] + 1, resident) - _holding(stages[k], held[k], resident) + stages[k].passed
            held[k] += 1
            base += stages[k].sent_forward
            peak = max(peak, now + stages[k].held + stages[k].forward + stages[k].passed)
            if copies is not None:
                copies.done.add((k, a.microbatch))
            continue
        if a.kind in (Kind.B, Kind.I):  # the gradients of what it took in memory are made
            now += stages[k].taken_grads
            kept += stages[k].taken_grads
        if a.kind in (Kind.B, Kind.W):  # what it passed in memory, and their gradients, go with its backward
            kept -= stages[k].passed + stages[k].passed_grads
        if a.kind == Kind.I and not stages[k].splits:
            kept += copies.drop(k, a.microbatch) if copies is not None else 0
            continue
        if a.kind in (Kind.B, Kind.I, Kind.W):
            whole = a.kind == Kind.B or not stages[k].splits
            base += stages[k].sent_backward if a.kind != Kind.W else 0
            fresh = stages[k].gradients if k not in grads and a.kind != Kind.I else 0
            # the gradients are made as the microbatch's activations are freed, node by node
            peak = max(peak, now + max(0, fresh - stages[k].held) + (stages[k].backward if a.kind != Kind.W or whole else 0))
            if not whole:
                kept += stages[k].seeds if a.kind == Kind.I else -stages[k].seeds
            kept += copies.drop(k, a.microbatch) if copies is not None else 0
            if a.kind != Kind.I:
                kept += fresh + _holding(stages[k], held[k] - 1, resident) - _holding(stages[k], held[k], resident)
                grads.add(k)
                held[k] -= 1
    final = base + sum(stages[k].gradients for k in mine)  # the sends waited on after the optimizer step
    return max(peak, final + step_transient)


def _holding(stage: StageBytes, inflight: int, resident: int) -> int:
    """What a stage holds on the device for `inflight` microbatches: all of each, but what
    it offloads of those beyond the `resident` ones (those brought back: `_Copies`)."""
    return inflight * stage.held - max(0, inflight - resident) * stage.offloaded


def stage_shares(peaks: Sequence[int], placement: Sequence[int], stages: Sequence[StageBytes]) -> list[int]:
    """Each stage's part of its rank's peak, for the manifest's per-stage `memory_bytes`:
    its own persistent bytes and gradients, and of the rest a part in proportion to what
    it holds per microbatch; the parts of a rank's stages sum to the rank's peak."""
    out = [0] * len(stages)
    for r, peak in enumerate(peaks):
        mine = [k for k, p in enumerate(placement) if p == r]
        own = [stages[k].persistent + stages[k].gradients for k in mine]
        rest, weight = peak - sum(own), sum(stages[k].held for k in mine) or 1
        for k, mine_own in zip(mine, own):
            out[k] = mine_own + rest * stages[k].held // weight
        out[mine[-1]] += peak - sum(out[k] for k in mine)
    return out
