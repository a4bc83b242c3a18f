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
    - the transient of the action: a forward's working set (what its nodes make and the
      stage does not keep, alive until the generated forward returns, or its largest
      node output where more); a backward's output gradient received, the gradients'
      first allocation beyond the activations it frees meanwhile (made node by node
      as the saved tensors go), and its input gradient made or the gradient flowing
      through the stage (its largest node output), whichever is more: the input
      gradient is the last the backward makes, from the gradient flowing into the
      stage's first nodes, once the nodes after them have freed what they saved; under
      --recompute the backward's second forward, at whose end every node output of the
      stage is alive (the generated forward keeps each in a local until it returns),
      or, where more, what the policy did not keep of one microbatch's activations with
      the flowing gradient; on the last stage the loss's logits gradient.

    After the last action, with data parallelism, every gradient is alive beside its
    copy in the all-reduce's flat buckets until the averages are written back.  The
    optimizer's step runs after that, with every gradient alive; its
    temporaries are those of one parameter at a time (torch's per-parameter loop on the
    CPU) and are counted as the largest parameter twice.  Not predicted: the memory an
    operator uses inside itself, the allocator's fragmentation and caching on a GPU, and
    what the loss function allocates beyond what it saves (see docs/memory.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

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
    #: with data parallelism, the copy of the stage's gradients flattened into the
    #: all-reduce's buckets (runtime/comm.GradBuckets), alive from the end of its last
    #: backward until the averages are written back, before the optimizer step
    reduced: int = 0
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
    table, rows = _Table.of(stages), _rows(schedule, pp, microbatches, virtual_stages)
    if ahead is None:
        return tuple(_walk(row, table, step_transient) for row in rows)
    made = _actions(schedule, pp, microbatches, virtual_stages)
    return tuple(_walk(row, table, step_transient, _copies(actions, table, ahead)) for row, actions in zip(rows, made))


class _Row(NamedTuple):
    """One rank's row of compute actions as arrays (an entry per action) of what the walk
    needs of their order: each action's stage and kind, the microbatches in flight on its
    stage before it, and whether it is the stage's first B or W (its gradients made)."""

    stage: np.ndarray
    kind: np.ndarray  # Kind.F, B, I, W as 0, 1, 2, 3
    before: np.ndarray
    first: np.ndarray
    mine: list[int]
    next_stage: np.ndarray  # the stage and kind of the action after each (the last: its own stage, W)
    next_kind: np.ndarray


_F, _B, _I, _W = range(4)
_KINDS = {Kind.F: _F, Kind.B: _B, Kind.I: _I, Kind.W: _W}


@functools.lru_cache(maxsize=256)
def _rows(schedule: str, pp: int, microbatches: int, virtual_stages: int) -> tuple[_Row, ...]:
    """The schedule's compute rows as arrays, made once per shape (the search walks thousands of plans)."""
    return tuple(_row(row) for row in _actions(schedule, pp, microbatches, virtual_stages))


@functools.lru_cache(maxsize=16)
def _actions(schedule: str, pp: int, microbatches: int, virtual_stages: int) -> tuple[tuple[Action, ...], ...]:
    """The schedule's compute rows, made once for `_rows` and for the copies of the shapes walked last."""
    return tuple(tuple(row) for row in schedule_spec(schedule).make(pp, microbatches, virtual_stages))


def _row(actions: Sequence[Action]) -> _Row:
    """`actions` as a `_Row`: an F puts a microbatch in flight on its stage, its B or W ends it."""
    inflight: dict[int, int] = {}
    graded: set[int] = set()
    before, first = [], []
    for a in actions:
        before.append(inflight.get(a.stage, 0))
        ends = a.kind in (Kind.B, Kind.W)
        first.append(ends and a.stage not in graded)
        if ends:
            graded.add(a.stage)
        inflight[a.stage] = before[-1] + (1 if a.kind == Kind.F else -1 if ends else 0)
    stage = np.array([a.stage for a in actions], dtype=np.int64)
    kind = np.array([_KINDS[a.kind] for a in actions], dtype=np.int64)
    return _Row(stage, kind, np.array(before, dtype=np.int64), np.array(first, dtype=bool), sorted(inflight),
                np.append(stage[1:], stage[-1:]), np.append(kind[1:], [_W] * min(1, len(kind))))


class _Table(NamedTuple):
    """The stages' StageBytes as one array a field, indexed by stage."""

    persistent: np.ndarray
    gradients: np.ndarray
    held: np.ndarray
    backward: np.ndarray
    seeds: np.ndarray
    forward: np.ndarray
    splits: np.ndarray
    sent_forward: np.ndarray
    sent_backward: np.ndarray
    reduced: np.ndarray
    offloaded: np.ndarray
    passed: np.ndarray
    passed_grads: np.ndarray
    taken_grads: np.ndarray

    @classmethod
    def of(cls, stages: Sequence[StageBytes]) -> _Table:
        return cls(*(np.array([getattr(s, name) for s in stages], dtype=np.int64) for name in cls._fields))


def _walk(row: _Row, t: _Table, step_transient: int, copies: tuple[np.ndarray, np.ndarray] | None = None) -> int:
    """One rank's peak: its row of compute actions walked in order, as prefix sums.

    Before action i the rank holds `base` (its stages' persistent bytes and receive
    buffers, and the sends not yet waited on) and `kept` (gradients, microbatches in
    flight, seeds): each the sum of the changes of the actions before it.  The action's
    own peak is that and its transient ([Note: the memory walk]); `copies`: offloading's
    copies done inside the compute, the bytes brought back before each action and those
    that go after it (`_copies`)."""
    k, kind, n = row.stage, row.kind, row.before
    is_f, is_b, is_i, is_w = kind == _F, kind == _B, kind == _I, kind == _W
    splits = t.splits[k].astype(bool)
    skipped = is_i & ~splits  # the I of a stage that does not split: W runs its whole backward
    resident = OFFLOAD_RESIDENT if copies is None else 0
    held, away = t.held[k], t.offloaded[k]

    def holding(count: np.ndarray) -> np.ndarray:  # all of each microbatch, but what is offloaded beyond the resident
        return count * held - np.maximum(0, count - resident) * away

    loads, drops = copies if copies is not None else (0, 0)
    taken = np.where(is_b | is_i, t.taken_grads[k], 0)
    fresh = np.where(row.first, t.gradients[k], 0)
    ends = np.where(is_b | is_w, fresh + holding(n - 1) - holding(n) - t.passed[k] - t.passed_grads[k], 0)
    change = np.select([is_f, is_i & splits, is_w & splits], [holding(n + 1) - holding(n) + t.passed[k],
                                                              taken + t.seeds[k], ends - t.seeds[k]], taken + ends)
    sent = np.select([is_f, (is_b | is_i) & ~skipped], [t.sent_forward[k], t.sent_backward[k]], 0)
    start = int(t.persistent[row.mine].sum())
    kept = np.cumsum(change + loads + drops) - (change + loads + drops)  # before each action
    now = start + np.cumsum(sent) - sent + kept + loads + _posted_ahead(row, t)
    whole = is_b | is_i | (is_w & ~splits)
    peak = np.select([is_f, skipped], [now + held + t.forward[k] + t.passed[k], np.iinfo(np.int64).min],
                     now + taken + np.maximum(0, fresh - held) + np.where(whole, t.backward[k], 0))
    final = start + int(sent.sum()) + int(t.gradients[row.mine].sum())  # the sends waited on after the optimizer step
    return max(start, int(peak.max(initial=start)), final + max(step_transient, int(t.reduced[row.mine].sum())))


def _posted_ahead(row: _Row, t: _Table) -> np.ndarray:
    """The receive buffers posted before each action for the compute after it ([Note:
    receives posted ahead] in runtime/schedule/lowering.py): a forward's inputs from other
    ranks (what its stage's I sends back, `sent_backward`), a backward's output gradients
    (what its stage's forward sends, `sent_forward`); none before a W.  Counted on every
    profile: the gloo the CPU runs posts them so, NCCL just before the compute (less)."""
    k, kind = row.next_stage, row.next_kind
    return np.select([kind == _F, (kind == _B) | (kind == _I)], [t.sent_backward[k], t.sent_forward[k]], 0)


def _copies(row: Sequence[Action], t: _Table, ahead: int) -> tuple[np.ndarray, np.ndarray]:
    """Where offloading's copies are done inside the compute, the bytes brought back before
    each action of `row` (as the runtime's `prefetches` says, or by the action that reads
    them) and, as negatives, those that go after it (a microbatch's copy after its
    backward or I, until W brings it back)."""
    loads, drops = np.zeros(len(row), dtype=np.int64), np.zeros(len(row), dtype=np.int64)
    back, done, loaded = prefetches(row, ahead), set(), set()
    for i, a in enumerate(row):
        for b in back.get(i, []) + ([a] if a.kind != Kind.F else []):
            if (b.stage, b.microbatch) in done and (b.stage, b.microbatch) not in loaded:
                loaded.add((b.stage, b.microbatch))
                loads[i] += t.offloaded[b.stage]
        if a.kind == Kind.F:
            done.add((a.stage, a.microbatch))
        elif (a.stage, a.microbatch) in loaded:
            loaded.discard((a.stage, a.microbatch))
            drops[i] -= t.offloaded[a.stage]
    return loads, drops


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
