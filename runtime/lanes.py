"""An in-process tensor-parallel group: T lanes, threads of one process, each a tp index
holding its own shards (`LocalPipeline`; entered with `runtime.tp.lane`).

[Note: lanes]
    A lane collective puts each lane's tensor in the lane's slot and waits at a barrier;
    then every lane computes the result from all the slots, in lane order (the sum
    x0 + x1 + ..., the shards joined in index order), so the result is bitwise the same
    on every lane, and waits again before anyone may reuse a slot.  Each wait has the
    timeout, and a lane that fails calls `Lanes.abort()`, so the others raise `PeerError`
    at once instead of hanging.  Forward collectives read the calling thread's group;
    each autograd Function keeps that group in its ctx for its backward.  The lanes must
    run their backward passes concurrently, each in its own thread: autograd runs a
    graph of CPU tensors in the thread that called backward(), but a CUDA graph's
    nodes on one worker thread per device, where lanes would wait on each other
    forever, so lanes are for CPU tensors only (LocalPipeline refuses tp > 1 on CUDA).
    Torch's CPU generator is one per process, so the lanes take turns: a lane runs only
    while it holds the group's turn, which it gives up while it waits in a collective,
    and each turn swaps in the lane's own generator state (the caller's, at first).  So
    each lane draws its dropout masks as a process of its own would ([Note: dropout
    streams] in modes.py), one lane computing at a time.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

from .comm import DEFAULT_TIMEOUT_S
from .errors import PeerError, PipelineError

__all__ = ["Lanes"]


class Lanes:
    """An in-process tensor-parallel group of `size` lanes (threads), [Note: lanes]."""

    def __init__(self, size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if size < 2:
            raise PipelineError(f"tp.Lanes: a group of {size} lane(s) needs no collectives: give 2 or more.")
        self.size, self.timeout_s = int(size), float(timeout_s)
        self.reset()

    def reset(self) -> None:
        """Ready for a new step (after an abort); call it while no lane is running."""
        self._slots: list[tuple[str, torch.Tensor] | None] = [None] * self.size
        self._barrier = threading.Barrier(self.size)
        self._failed: int | None = None
        self._turn = threading.Lock()
        self._rng: list[torch.Tensor | None] = [None] * self.size  # each lane's generator state between turns
        self._outside = torch.get_rng_state()  # the caller's, set back whenever no lane holds the turn

    def take_turn(self, index: int) -> None:
        """Lane `index` runs from now on, with its own generator state ([Note: lanes])."""
        self._turn.acquire()
        self._outside = torch.get_rng_state()
        own = self._rng[index]
        if own is not None:
            torch.set_rng_state(own)

    def give_turn(self, index: int, done: bool = False) -> None:
        """Lane `index` waits (or, `done`, has finished): keep its generator state, let another run."""
        self._rng[index] = None if done else torch.get_rng_state()
        torch.set_rng_state(self._outside)
        self._turn.release()

    def abort(self, index: int | None = None) -> None:
        """Lane `index` failed: every lane waiting, now or later, raises PeerError."""
        if self._failed is None:
            self._failed = index
        self._barrier.abort()

    def exchange(self, index: int, x: torch.Tensor, collective: str,
                 combine: Callable[[list[torch.Tensor]], torch.Tensor]) -> torch.Tensor:
        """combine(every lane's x, in lane order), computed by each lane (x is only read)."""
        self._slots[index] = (collective, x)
        self._wait(index, collective)
        try:
            slots = [s for s in self._slots if s is not None]
            names = sorted({name for name, _ in slots})
            if len(slots) != self.size or len(names) != 1:
                raise PipelineError(f"tensor-parallel lane {index}: the lanes met in different collectives "
                                    f"({'; '.join(names)}): every lane must run the same stage code in the same order.")
            out = combine([t for _, t in slots])
        except BaseException:
            self.abort(index)
            raise
        self._wait(index, collective)
        return out

    def _wait(self, index: int, collective: str) -> None:
        self.give_turn(index)
        try:
            self._barrier.wait(self.timeout_s)
        except threading.BrokenBarrierError:
            failed = self._failed
            if failed is None or failed == index:
                self._failed = index
                raise PeerError(f"tensor-parallel lane {index} of {self.size} timed out in {collective}: another "
                                f"lane did not reach it in {self.timeout_s:g} s. If it is only slow, raise "
                                f"PIPELINE_TIMEOUT_S.") from None
            raise PeerError(f"tensor-parallel lane {index} of {self.size} stopped in {collective}: lane {failed} "
                            f"failed (its own error is the one to look at).") from None
        finally:
            self.take_turn(index)
