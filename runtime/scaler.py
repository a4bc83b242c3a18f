"""`runtime.GradScaler`: torch.amp.GradScaler for `--precision fp16-mixed` pipelines.

[Note: a global loss scale]
    fp16 gradients overflow; GradScaler multiplies the loss by a scale, divides the
    gradients by it before the optimizer step, and skips the step (halving the scale) when
    any gradient is inf or nan.  In a pipeline each rank holds only its stages' gradients,
    so one rank can overflow while the others do not; stepping on some ranks and not on
    others would tear the model apart.  Here the check is global: after unscaling, the
    found-inf flag is all-reduced (MAX) over every rank, so a step skipped on one rank is
    skipped on all, and every rank's scale follows the same history.  Every rank calls
    `step` (with None where it holds no parameters) and `update`, once per step.

    Usage (on every rank):
        scaler = runtime.GradScaler("cpu")        # or "cuda"
        loss = pipe.train_step(x, y, loss_fn=scaler.loss_fn(loss_fn))   # the scaled loss
        scaler.unscale_(opt)                       # only to clip: the true gradients, and the check
        pipe.clip_grad_norm_(max_norm)
        scaler.step(opt)                           # opt, or None on a rank without parameters
        scaler.update()

    `unscale_` makes the check (with None on a rank without parameters, which then holds
    the global flag for its `step(None)`), so `step` does not make it again: every rank
    joins one all-reduce per step either way.
"""

from __future__ import annotations

import datetime
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["GradScaler", "agree"]


class GradScaler(torch.amp.GradScaler):
    """torch.amp.GradScaler whose inf/nan check spans every rank ([Note: a global loss scale])."""

    def __init__(self, device: str = "cpu", timeout_s: float = 60.0, **kwargs: Any) -> None:
        super().__init__(device, **kwargs)
        if self._enabled:  # every rank holds a scale, also those that never compute the loss
            self._lazy_init_scale_growth_tracker(torch.device(device))
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._found_here: torch.Tensor | None = None  # the global flag, on a rank without an optimizer

    def loss_fn(self, fn: Callable[[Any, Any], torch.Tensor]) -> Callable[[Any, Any], torch.Tensor]:
        """`fn` with its loss multiplied by the current scale (for `train_step(loss_fn=...)`)."""
        return lambda output, target: self.scale(fn(output, target))

    def unscale_(self, optimizer: torch.optim.Optimizer | None) -> None:
        """As GradScaler.unscale_, with the found-inf flag made global; None on a rank
        without parameters, which still joins the check."""
        if optimizer is None:
            if self._enabled:
                self._found_here = self._global(torch.zeros((), device=self._device_of()))
            return
        super().unscale_(optimizer)
        if not self._enabled:
            return
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        total = self._global(sum((v.to(self._device_of()) for v in found.values()),
                                 torch.zeros((), device=self._device_of())))
        for v in found.values():
            v.copy_(total)

    def step(self, optimizer: torch.optim.Optimizer | None = None, *args: Any, **kwargs: Any) -> Any:
        """As GradScaler.step; None on a rank without parameters, which still joins the check."""
        if not self._enabled:
            return None if optimizer is None else optimizer.step(*args, **kwargs)
        if optimizer is None:
            if self._found_here is None:  # not yet checked by unscale_(None)
                self._found_here = self._global(torch.zeros((), device=self._device_of()))
            return None
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        if self._found_here is not None and not self._per_optimizer_states and new_scale is None:
            scale, growth = self._check_scale_growth_tracker("update")
            torch._amp_update_scale_(scale, growth, self._found_here, self._growth_factor, self._backoff_factor,
                                     self._growth_interval)
            self._found_here = None
            return
        self._found_here = None
        super().update(new_scale)

    def _device_of(self) -> torch.device:
        assert self._scale is not None
        return self._scale.device

    def _global(self, found: torch.Tensor) -> torch.Tensor:
        return agree(found, self._timeout)


def agree(found: torch.Tensor, timeout: datetime.timedelta) -> torch.Tensor:
    """The largest of every rank's flag (this rank's alone outside torch.distributed): one
    all-reduce, so that every rank takes the same decision."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return found
    flag = found.detach().clone().float()
    work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)
    work.wait(timeout)
    return flag
