"""Activation offloading: what a stage saves for backward moved to host memory after its
forward and brought back ahead of the backward that needs it (`--offload`).

[Note: activation offloading]
    A stage whose manifest entry has `offload` f > 0 runs each training forward under
    `torch.autograd.graph.saved_tensors_hooks`.  The pack hook takes the STORAGE of each
    saved tensor (once per storage and microbatch: a tensor and its views, saved by
    several ops, share one handle) and hands autograd a handle instead; the unpack hook
    gives back the same view of a device copy of that storage.  Kept on the device:
    leaves and the storages of the stage's parameters, buffers and inputs (held anyway,
    and not activations) and storages under `MIN_BYTES`.  Of the rest, with f = 1 every
    storage is copied to a host buffer as it is saved, so the device storage is freed as
    soon as the forward lets go of it.  With f < 1 the handles hold the device storages
    until the forward ends, when the stage knows this microbatch's saved storages in the
    order they were saved, and then copies out the fewest first ones whose bytes reach f
    of them all (`share_of`: the first saved are needed last, so they have the longest
    to come back).  The share is honoured to the storage on every microbatch, the first
    included, and the planner, which knows the same storages in the same order ([Note:
    saved bytes per stage] in partitioner/cost/saved.py), predicts the bytes that
    leaves on the device with `share_of` itself.  (A fraction, not a byte count, is what
    the manifest keeps: it holds for a short last microbatch too, and reads the same in
    older packages.)
    On CUDA the copies run on a side stream into pinned buffers: the copy out waits for
    the compute stream, and `record_stream` keeps the device storage from reuse until it
    is done; `prefetch(microbatch)` starts the copies back on the side stream, and the
    unpack makes the compute stream wait for them.  The pipelines call `prefetch`
    `PIPELINE_OFFLOAD_AHEAD` compute actions of the rank's row (default 1, the
    activation loading horizon; messages not counted) before each B, I or W of an
    offloading stage (`prefetches`), the first ones' at the row's start; an unpack that
    finds nothing prefetched copies at once.  On the CPU the same code runs without
    streams: the host buffer is a separate tensor, the copy out is done when the pack
    (f = 1) or the forward (f < 1) returns, and the saved storage is really released.
    A copy brought back stays until the microbatch's backward is done; under a split
    backward ([Note: split backward] in stage.py) the copies are dropped after I
    (`evict`) and brought back again ahead of W.  The host buffers live as long as the
    autograd graph holds their handles; the hooks, which that graph also holds, forget
    the microbatch when its backward starts (`release`), so nothing outlives it.  Under
    `--recompute` autograd saves only what torch.utils.checkpoint keeps outside its own
    hooks, so little is offloaded.
    Hooks already in force when the stage's forward starts (the memory tracker's,
    runtime/memory.py) still see every saved tensor: the pack calls theirs first.  The
    host buffers are made outside any TorchDispatchMode, so the tracker counts what the
    device holds: the copies brought back count as "other".
"""

from __future__ import annotations

import contextlib
import os
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .schedule import Action, Kind

__all__ = ["AHEAD", "MIN_BYTES", "Offloader", "ahead", "bring_back", "prefetches", "prefetches_in_order", "share_of"]

MIN_BYTES = 1024  # smaller saved tensors stay: their copies would cost more than they free
AHEAD = 1  # the default activation loading horizon, in compute actions: the next comes back during this one

_Outer = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None


def ahead() -> int:
    """The activation loading horizon: `PIPELINE_OFFLOAD_AHEAD` actions, default `AHEAD`."""
    return max(0, int(os.environ.get("PIPELINE_OFFLOAD_AHEAD", AHEAD)))


def share_of(sizes: Sequence[int], fraction: float) -> int:
    """How many of the first of `sizes` (saved storages, in the order saved) an offloading
    stage copies out: the fewest whose bytes reach `fraction` of them all ([Note:
    activation offloading])."""
    want, total = fraction * sum(sizes), 0
    for n, size in enumerate(sizes):
        if total >= want:
            return n
        total += size
    return len(sizes)


def prefetches(row: Sequence[Action], horizon: int) -> dict[int, list[Action]]:
    """Per index of one rank's `row` (lowered or not), the B, I and W to bring back before
    it runs: each `horizon` compute actions before its own, the first ones' at the start
    ([Note: activation offloading])."""
    computes = [t for t, a in enumerate(row) if a.is_compute]
    out: dict[int, list[Action]] = {}
    for c, t in enumerate(computes):
        if _reads_saved(row[t]):
            out.setdefault(computes[max(0, c - horizon)], []).append(row[t])
    return out


def prefetches_in_order(order: Sequence[tuple[int, Action]], horizon: int) -> dict[int, list[Action]]:
    """`prefetches` for a serial order of several ranks' actions ((rank, action) pairs):
    each rank's counted in its own row."""
    rows: dict[int, list[int]] = {}
    for t, (rank, _) in enumerate(order):
        rows.setdefault(rank, []).append(t)
    out: dict[int, list[Action]] = {}
    for positions in rows.values():
        for i, found in prefetches([order[t][1] for t in positions], horizon).items():
            out.setdefault(positions[i], []).extend(found)
    return out


def bring_back(actions: Sequence[Action], runners: Mapping[int, Any] | Sequence[Any]) -> None:
    """Start bringing back what each of `actions` will read (`runners`: the stages' runners, by index)."""
    for a in actions:
        runners[a.stage].prefetch(a.microbatch)


def _reads_saved(a: Action) -> bool:
    """Whether action `a` unpacks what a forward saved: a backward, or its halves."""
    return a.kind.sends_grads or a.kind == Kind.W


@dataclass
class _Held:
    """One saved storage: its bytes, its host buffer once copied out, and a device copy
    (the storage itself until then, or the copy brought back)."""

    device: torch.device
    nbytes: int
    host: torch.Tensor | None = None
    copied: Any = None  # the CUDA event after the copy to the host
    back: torch.Tensor | None = None
    loaded: Any = None  # the CUDA event after the copy back


@dataclass(frozen=True)
class _View:
    """A saved tensor as a view of an offloaded storage."""

    held: _Held
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass
class _Forward:
    """What one microbatch's forward saved, by storage (its data pointer)."""

    kept: set[int]  # storages held anyway: parameters, buffers, inputs
    #: each storage's handle, and the tensors saved from it (while one lives, so does the storage)
    held: dict[int, tuple[list[weakref.ref[torch.Tensor]], _Held]] = field(default_factory=dict)
    order: list[_Held] = field(default_factory=list)  # the handles in the order saved
    offloaded_bytes: int = 0


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _on(t: torch.Tensor | None, key: int) -> bool:
    """Whether `t` is alive and a view of the storage at `key`."""
    return t is not None and _key(t) == key


@dataclass
class Offloader:
    """The offloading of one stage ([Note: activation offloading]): `fraction` of the bytes
    it saves."""

    fraction: float
    _mbs: dict[int, _Forward] = field(default_factory=dict)
    moved_bytes: int = 0  # copied to the host since it was made
    _stream: Any = None

    @contextlib.contextmanager
    def forward(self, microbatch: int, kept: list[torch.Tensor]) -> Iterator[None]:
        """The hooks, for one microbatch's training forward; `kept`: the tensors whose
        storages stay (the module's parameters and buffers, the stage's inputs)."""
        outer: _Outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        fwd = self._mbs[microbatch] = _Forward({_key(t) for t in kept})
        with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(t, fwd, outer),
                                                      lambda h: self._unpack(h, outer)):
            yield
        if self.fraction < 1:
            self._copy_share(fwd)

    def _copy_share(self, fwd: _Forward) -> None:
        """At a forward's end, copy out the first saved storages up to the share (`share_of`)."""
        for held in fwd.order[:share_of([h.nbytes for h in fwd.order], self.fraction)]:
            source, held.back = held.back, None
            assert source is not None
            self._to_host(held, source)
            fwd.offloaded_bytes += held.nbytes

    def release(self, microbatch: int) -> None:
        """Forget a microbatch whose backward has begun: the autograd graph holds its
        handles (host buffers, device copies) as long as it needs them.  The hooks outlive
        the forward in that graph, so the record goes empty here."""
        fwd = self._mbs.pop(microbatch, None)
        if fwd is not None:
            fwd.held.clear()
            fwd.order.clear()

    def clear(self) -> None:
        for mb in list(self._mbs):
            self.release(mb)

    def offloaded_bytes(self, microbatch: int) -> int:
        """The bytes one microbatch in flight has on the host."""
        fwd = self._mbs.get(microbatch)
        return fwd.offloaded_bytes if fwd is not None else 0

    def evict(self, microbatch: int) -> None:
        """Drop the device copies of a microbatch between its I and W (the host keeps them)."""
        fwd = self._mbs.get(microbatch)
        for _, held in (fwd.held.values() if fwd is not None else ()):
            if held.host is not None:  # the storages kept on the device stay
                held.back = held.loaded = None

    def prefetch(self, microbatch: int) -> None:
        """Start bringing a microbatch's storages back (once; a no-op when they are)."""
        fwd = self._mbs.get(microbatch)
        for _, held in (fwd.held.values() if fwd is not None else ()):
            if held.back is None:
                self._load(held)

    # -- the hooks ---------------------------------------------------------------------------------

    def _pack(self, t: torch.Tensor, fwd: _Forward, outer: _Outer) -> Any:
        inner = outer[0](t) if outer is not None else t
        held = self._offload(t, fwd)
        if held is None:
            return (False, inner)
        return (True, _View(held, t.dtype, int(t.storage_offset()), tuple(t.shape), tuple(t.stride())))

    def _offload(self, t: torch.Tensor, fwd: _Forward) -> _Held | None:
        """`t`'s storage's handle (one per forward), or None where it stays."""
        if t.device.type == "meta" or t.is_leaf:
            return None
        storage, key = t.untyped_storage(), _key(t)
        known = fwd.held.get(key)
        if known is not None and any(_on(ref(), key) for ref in known[0]):
            known[0].append(weakref.ref(t))
            return known[1]
        if key in fwd.kept or storage.nbytes() < MIN_BYTES:
            return None
        held = _Held(t.device, storage.nbytes())
        with _disable_current_modes(), torch.no_grad():
            source = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
        if self.fraction < 1:
            held.back = source  # until the forward's end chooses the share
        else:
            self._to_host(held, source)
            fwd.offloaded_bytes += held.nbytes
        fwd.held[key] = ([weakref.ref(t)], held)
        fwd.order.append(held)
        return held

    def _unpack(self, packed: tuple[bool, Any], outer: _Outer) -> torch.Tensor:
        offloaded, inner = packed
        if not offloaded:
            return outer[1](inner) if outer is not None else inner
        view: _View = inner
        held = view.held
        if held.back is None:
            self._load(held)
        assert held.back is not None
        if held.loaded is not None:
            current = torch.cuda.current_stream(held.device)
            current.wait_event(held.loaded)
            held.back.record_stream(current)
        with torch.no_grad():
            return torch.empty(0, dtype=view.dtype, device=held.device).set_(
                held.back.untyped_storage(), view.offset, view.size, view.stride)

    # -- the copies --------------------------------------------------------------------------------

    def _side(self, device: torch.device) -> Any:
        """The side stream of the copies on CUDA; None on the CPU."""
        if device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _to_host(self, held: _Held, source: torch.Tensor) -> None:
        """Copy `source` (a storage's bytes) into a new host buffer of `held`."""
        side = self._side(held.device)
        self.moved_bytes += held.nbytes
        with _disable_current_modes(), torch.no_grad():
            held.host = torch.empty(source.shape, dtype=torch.uint8, device="cpu", pin_memory=side is not None)
            if side is None:
                held.host.copy_(source)
                return
            side.wait_stream(torch.cuda.current_stream(held.device))
            with torch.cuda.stream(side):
                held.host.copy_(source, non_blocking=True)
                held.copied = torch.cuda.Event()
                held.copied.record(side)
            source.record_stream(side)  # the storage is not reused before the copy is done

    def _load(self, held: _Held) -> None:
        side = self._side(held.device)
        with torch.no_grad():
            assert held.host is not None
            if side is None:
                held.back = held.host.to(held.device, copy=True)
                return
            with torch.cuda.stream(side):
                side.wait_event(held.copied)
                held.back = held.host.to(held.device, non_blocking=True)
                held.loaded = torch.cuda.Event()
                held.loaded.record(side)
