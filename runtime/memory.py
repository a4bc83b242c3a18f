"""Measured memory of one process's step, by kind, beside the plan's prediction
(`pipe.track_memory(True)`, then `pipe.memory_stats()`).

[Note: measured memory]
While tracking is on, each `train_step`, `evaluate` or `pipe(inputs)` opens a window,
and the `step()` of an optimizer made by `pipe.make_optimizer` that follows it joins the
same window.  Inside it a TorchDispatchMode sees every tensor an operator returns and
follows its storage through a weakref (so a storage is counted once, however many views
share it, and leaves the count when it is freed); the storages alive when the window
opens (parameters, gradients, optimizer state, buffers) are counted from the start.  At
each new peak of the total, the bytes are split by kind: parameters (the stage modules'
parameter storages), gradients (their `.grad`), optimizer state (the optimizer's state
tensors), activations (storages that autograd saved for backward, seen through
`saved_tensors_hooks`, parameters excepted) and other (the rest: buffers, messages,
temporaries, outputs).  So the kinds sum to the total at the peak.  On CUDA the total is
at least `torch.cuda.max_memory_allocated` over the window (the allocator's own figure).

MemTracker (torch.distributed._tools.mem_tracker) is not used: its "activations" are
every tensor made inside a module's forward (under `no_grad` too), it refuses a module
called once per microbatch, and its gradient hooks break the split backward of the
zero-bubble schedules; this one mode serves every schedule with the same figures.
Tensor-parallel lanes that LocalPipeline runs in threads are not seen by the mode (it is
thread-local), and nor is the memory an operator uses inside itself.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .errors import PipelineError

__all__ = ["MemoryStats", "MemoryTracker", "NotTrackedError", "KINDS"]

KINDS = ("parameters", "gradients", "optimizer", "activations", "other")
_PARAM, _GRAD, _OPT, _ACT, _OTHER = range(5)


class NotTrackedError(PipelineError):
    """memory_stats() was asked for before any step ran with tracking on."""


@dataclass(frozen=True)
class MemoryStats:
    """One process's peak bytes in its last tracked step, split by kind at the peak
    ([Note: measured memory]), and the plan's prediction for the stages it holds."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    other: int
    total: int
    predicted: int

    def __str__(self) -> str:
        kinds = ", ".join(f"{k} {_mib(getattr(self, k))}" for k in KINDS)
        ratio = f" ({self.total / self.predicted:.2f}x)" if self.predicted else ""
        return f"measured {_mib(self.total)}{ratio} ({kinds}); predicted {_mib(self.predicted)}"


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _storage(t: torch.Tensor) -> Any:
    """The storage object of `t` (one per storage, however many views share it)."""
    return t.untyped_storage()


class _Seen(TorchDispatchMode):
    """Hands every tensor an operator returns to `see` ([Note: measured memory])."""

    def __init__(self, see: Callable[[torch.Tensor], None]) -> None:
        super().__init__()
        self._see = see

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._see(t)
        return out


class MemoryTracker:
    """The windows of [Note: measured memory] for one pipeline: `params`, a method of the
    pipeline, gives its parameters (module weights and masters); costs nothing while off."""

    def __init__(self, params: Callable[[], list[torch.nn.Parameter]]) -> None:
        self.on = False
        # held weakly: the pipeline owns this tracker, and a bound method would hold the
        # pipeline in a cycle that outlives its last reference
        self._params_of = weakref.WeakMethod(params)  # type: ignore[arg-type]
        self._optimizers: list[weakref.ref[torch.optim.Optimizer]] = []
        self._live: dict[int, list[int]] = {}  # storage key -> [bytes, kind]
        self._by_kind = [0] * len(KINDS)  # the live bytes of each kind
        self._current = self._peak = 0
        self._split: tuple[int, ...] | None = None
        self._cuda_peak = 0

    def _params(self) -> list[torch.nn.Parameter]:
        method = self._params_of()
        return method() if method is not None else []

    def watch(self, opt: torch.optim.Optimizer) -> None:
        """Let `opt.step()` join the window of the step before it."""
        self._optimizers.append(weakref.ref(opt))
        mode: list[contextlib.ExitStack] = []
        opt.register_step_pre_hook(lambda *_: self._enter_optimizer(mode))
        opt.register_step_post_hook(lambda *_: self._leave_optimizer(mode))

    def window(self) -> ContextManager[None]:
        """A step's window when tracking is on (a fresh one), else nothing."""
        return self._window() if self.on else contextlib.nullcontext()

    @contextlib.contextmanager
    def _window(self) -> Iterator[None]:
        self._open()
        with self._seeing():
            yield
        self._close_cuda()

    def stats(self, predicted: int) -> MemoryStats:
        """The last window's figures."""
        if self._split is None:
            raise NotTrackedError(
                "memory_stats() was called but no step ran with memory tracking on, so nothing was measured. "
                "Call pipe.track_memory(True) before the train_step (or evaluate) to measure.")
        params, grads, opt, acts, other = self._split
        return MemoryStats(params, grads, opt, acts, other, max(sum(self._split), self._cuda_peak), predicted)

    # -- a window ----------------------------------------------------------------------------------

    def _open(self) -> None:
        self._live, self._current, self._peak, self._split = {}, 0, 0, None
        self._by_kind = [0] * len(KINDS)
        for t in self._persistent():
            self._see(t)
        self._update_peak()
        self._open_cuda()

    @contextlib.contextmanager
    def _seeing(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._saved, lambda t: t), _Seen(self._see):
            yield

    def _enter_optimizer(self, mode: list[contextlib.ExitStack]) -> None:
        if self.on and self._split is not None:
            stack = contextlib.ExitStack()
            stack.enter_context(_Seen(self._see))
            mode.append(stack)

    def _leave_optimizer(self, mode: list[contextlib.ExitStack]) -> None:
        while mode:
            mode.pop().close()
            if self._current >= self._peak:  # the state made by this step, at the peak it ends on
                self._update_peak()
            self._close_cuda()

    def _persistent(self) -> Iterable[torch.Tensor]:
        """What is alive before a step: parameters, gradients, optimizer state."""
        for p in self._params():
            yield p
            if p.grad is not None:
                yield p.grad
        for t in self._optimizer_state():
            yield t

    def _optimizer_state(self) -> Iterator[torch.Tensor]:
        for ref in self._optimizers:
            opt = ref()
            opt = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps this rank's part in .optim
            for state in (opt.state.values() if opt is not None else ()):
                yield from (v for v in state.values() if isinstance(v, torch.Tensor))

    # -- the counts --------------------------------------------------------------------------------

    def _see(self, t: torch.Tensor) -> None:
        st = _storage(t)
        key = st._cdata
        if key in self._live or t.device.type == "meta":
            return
        n = st.nbytes()
        self._live[key] = [n, _OTHER]
        self._current += n
        self._by_kind[_OTHER] += n
        weakref.finalize(st, self._freed, key)
        if self._current > self._peak:
            self._update_peak()

    def _freed(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self._current -= entry[0]
            self._by_kind[entry[1]] -= entry[0]

    def _saved(self, t: torch.Tensor) -> torch.Tensor:
        """The pack hook: `t`'s storage is an activation (unless a parameter's).  It packs
        `t.detach()` (the same storage and version counter): a pack hook that returns an
        op's own output makes output -> node -> output a cycle that Python's collector
        cannot see, and under `retain_graph=True` (the split backward's I) the nodes W
        does not run would then never free what they saved."""
        if isinstance(t, torch.Tensor):
            self._see(t)
            self._kind(t, _ACT)
            return t.detach()
        return t

    def _kind(self, t: torch.Tensor, kind: int) -> None:
        """`t`'s storage is of `kind` unless already of a stronger one (a lower number: a
        parameter saved for backward stays a parameter)."""
        entry = self._live.get(_storage(t)._cdata)
        if entry is not None and kind < entry[1]:
            self._by_kind[entry[1]] -= entry[0]
            self._by_kind[kind] += entry[0]
            entry[1] = kind

    def _mark(self, tensors: Iterable[torch.Tensor], kind: int) -> None:
        for t in tensors:
            self._kind(t, kind)

    def _classify(self) -> None:
        """Give the parameters', gradients' and optimizer state's storages their kind."""
        params = self._params()
        self._mark(params, _PARAM)
        self._mark((p.grad for p in params if p.grad is not None), _GRAD)
        self._mark(self._optimizer_state(), _OPT)

    def _update_peak(self) -> None:
        self._peak = self._current
        self._classify()
        self._split = tuple(self._by_kind)

    # -- CUDA ------------------------------------------------------------------------------------

    def _cuda(self) -> list[torch.device]:
        return list({p.device for p in self._params() if p.device.type == "cuda"})

    def _open_cuda(self) -> None:
        self._cuda_peak = 0
        for d in self._cuda():
            torch.cuda.reset_peak_memory_stats(d)

    def _close_cuda(self) -> None:
        peak = sum(torch.cuda.max_memory_allocated(d) for d in self._cuda())
        self._cuda_peak = max(self._cuda_peak, peak)
