"""`runtime.GradScaler`: torch.amp.GradScaler for `--precision fp16-mixed` pipelines; and
`runtime.finite_step` (`partitioner run --on-nonfinite skip|stop`), which agrees as it does.

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

[Note: non-finite steps]
    A step whose loss or gradients hold a nan or an inf would write them into every
    weight.  After the backward (and after clipping, whose norm is then not finite
    either), each rank looks at the loss (every rank holds it) and at the gradients of
    the parameters its optimizer updates, and the ranks agree by one all-reduce (MAX) of
    that flag (`scaler.agree`, as [Note: a global loss scale] does), so a step is taken
    on every rank or on none.  skip: the gradients are zeroed and the caller takes neither
    the optimizer step nor the LR scheduler step (the batch is used up all the same);
    stop: NonFiniteError names the step.  Under fp16-mixed only the loss is looked at:
    gradients that overflow are the GradScaler's, which skips those steps by itself.

    Usage (on every rank, in a script):
        loss = pipe.train_step(x, y, loss_fn=loss_fn)
        if runtime.finite_step(loss, opt, step=k, on_nonfinite="skip"):
            opt.step()
            sched.step()
"""

from __future__ import annotations

import datetime
from typing import Any, Callable

import torch
import torch.distributed as dist

from .errors import NonFiniteError, PipelineError

__all__ = ["GradScaler", "agree", "CHOICES", "finite_step", "is_finite"]


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


CHOICES = ("skip", "stop")


def is_finite(loss: torch.Tensor, optimizer: torch.optim.Optimizer | None, grads: bool = True,
              timeout_s: float = 60.0) -> bool:
    """Whether the loss and (with `grads`) the gradients are finite on EVERY rank
    (collective: one all-reduce; a rank without parameters passes None)."""
    bad = not bool(torch.isfinite(loss.detach()).all())
    if grads and optimizer is not None and not bad:
        held = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        bad = any(not bool(torch.isfinite(g).all()) for g in held)
    flag = torch.tensor(float(bad), device=loss.device)
    return not bool(agree(flag, datetime.timedelta(seconds=timeout_s)).item())


def finite_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer | None, step: int,
                on_nonfinite: str = "skip", grads: bool = True, timeout_s: float = 60.0) -> bool:
    """True when the optimizer step may be taken ([Note: non-finite steps]); else, under
    "skip", the gradients are zeroed and False is returned (take no optimizer or scheduler
    step), under "stop" NonFiniteError names `step`.  Collective: call on every rank."""
    if on_nonfinite not in CHOICES:
        raise PipelineError(f"on_nonfinite={on_nonfinite!r}: give one of {', '.join(CHOICES)}.")
    if is_finite(loss, optimizer, grads, timeout_s):
        return True
    if on_nonfinite == "stop":
        raise NonFiniteError(f"step {step}: the loss ({loss.item():g}) or a gradient is not finite (nan or inf) on "
                             f"at least one rank, and --on-nonfinite stop ends the run here (no weight was changed by "
                             f"this step): look at the data of step {step} (the model file's batches()) and the "
                             f"learning rate, resume from the last checkpoint, or pass --on-nonfinite skip to skip "
                             f"such steps on every rank.")
    if optimizer is not None:
        optimizer.zero_grad()
    return False
