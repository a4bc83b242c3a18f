"""Activation offloading: what a stage saves for backward moved to host memory after its
forward and brought back ahead of the backward that needs it (`--offload`).

[Note: activation offloading]
    A stage whose manifest entry has `offload` f > 0 runs each training forward under
    `torch.autograd.graph.saved_tensors_hooks`.  The pack hook copies the STORAGE of each
    saved tensor to a host buffer (once per storage and microbatch: a tensor and its
    views, saved by several ops, share one copy) and hands autograd a handle instead, so
    the device storage is freed as soon as nothing else holds it; the unpack hook gives
    back the same view of a device copy of that storage.  Kept on the device: leaves and
    the storages of the stage's parameters, buffers and inputs (held anyway, and not
    activations), storages under `MIN_BYTES`, and past the fraction f of the bytes the
    stage saved in its previous forward (the first saved first: needed last, they have
    the longest to come back; the first forward offloads all it may).
    On CUDA the copies run on a side stream into pinned buffers: the copy out waits for
    the compute stream, and `record_stream` keeps the device storage from reuse until it
    is done; `prefetch(microbatch)` starts the copies back on the side stream, and the
    unpack makes the compute stream wait for them.  The pipelines call `prefetch`
    `PIPELINE_OFFLOAD_AHEAD` actions (default 2, the activation loading horizon) before
    each B, I or W of an offloading stage; an unpack that finds nothing prefetched copies
    at once.  On the CPU the same code runs without streams: the host buffer is a
    separate tensor, and the saved storage is really released.
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
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .schedule import Action, Kind

__all__ = ["AHEAD", "MIN_BYTES", "Offloader", "ahead", "prefetch_ahead"]

MIN_BYTES = 1024  # smaller saved tensors stay: their copies would cost more than they free
AHEAD = 2  # the default activation loading horizon, in schedule actions

_Outer = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None


def ahead() -> int:
    """The activation loading horizon: `PIPELINE_OFFLOAD_AHEAD` actions, default `AHEAD`."""
    return max(0, int(os.environ.get("PIPELINE_OFFLOAD_AHEAD", AHEAD)))


def prefetch_ahead(actions: list[Action], t: int, prefetch: Callable[[Action], None], horizon: int) -> None:
    """Before action `t` of a row: `prefetch` the B, I or W `horizon` actions on, which
    brings its microbatch back in time ([Note: activation offloading])."""
    if horizon > 0 and t + horizon < len(actions) and _reads_saved(actions[t + horizon]):
        prefetch(actions[t + horizon])
    if t == 0:  # the first actions of a row have nothing before them to prefetch from
        for a in actions[:horizon]:
            if _reads_saved(a):
                prefetch(a)


def _reads_saved(a: Action) -> bool:
    """Whether action `a` unpacks what a forward saved: a backward, or its halves."""
    return a.kind.sends_grads or a.kind == Kind.W


@dataclass
class _Held:
    """One offloaded storage: its host buffer (bytes), and a device copy once brought back."""

    host: torch.Tensor
    device: torch.device
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
    """What one microbatch's forward offloaded, by storage (its data pointer)."""

    kept: set[int]  # storages held anyway: parameters, buffers, inputs
    #: each storage's copy, and the tensors saved from it (while one lives, so does the storage)
    held: dict[int, tuple[list[weakref.ref[torch.Tensor]], _Held]] = field(default_factory=dict)
    saved_bytes: int = 0  # every storage the hook could offload
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
    _budget: float | None = None  # bytes to offload per forward: the fraction of the last one's
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
        self._budget = self.fraction * fwd.saved_bytes

    def release(self, microbatch: int) -> None:
        """Forget a microbatch whose backward has begun: the autograd graph holds its
        handles (host buffers, device copies) as long as it needs them.  The hooks outlive
        the forward in that graph, so the record goes empty here."""
        fwd = self._mbs.pop(microbatch, None)
        if fwd is not None:
            fwd.held.clear()

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
        """`t`'s storage on the host (copied once per forward), or None where it stays."""
        if t.device.type == "meta" or t.is_leaf:
            return None
        storage, key = t.untyped_storage(), _key(t)
        known = fwd.held.get(key)
        if known is not None and any(_on(ref(), key) for ref in known[0]):
            known[0].append(weakref.ref(t))
            return known[1]
        nbytes = storage.nbytes()
        if key in fwd.kept or nbytes < MIN_BYTES:
            return None
        fwd.saved_bytes += nbytes
        if self.fraction < 1 and self._budget is not None and fwd.offloaded_bytes + nbytes > self._budget:
            return None
        held = self._to_host(storage, t.device)
        fwd.held[key] = ([weakref.ref(t)], held)
        fwd.offloaded_bytes += nbytes
        self.moved_bytes += nbytes
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

    def _to_host(self, storage: Any, device: torch.device) -> _Held:
        side = self._side(device)
        with _disable_current_modes(), torch.no_grad():
            source = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
            host = torch.empty(source.shape, dtype=torch.uint8, device="cpu", pin_memory=side is not None)
            held = _Held(host, device)
            if side is None:
                host.copy_(source)
                return held
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                host.copy_(source, non_blocking=True)
                held.copied = torch.cuda.Event()
                held.copied.record(side)
            source.record_stream(side)  # the storage is not reused before the copy is done
        return held

    def _load(self, held: _Held) -> None:
        side = self._side(held.device)
        with torch.no_grad():
            if side is None:
                held.back = held.host.to(held.device, copy=True)
                return
            with torch.cuda.stream(side):
                side.wait_event(held.copied)
                held.back = held.host.to(held.device, non_blocking=True)
                held.loaded = torch.cuda.Event()
                held.loaded.record(side)
