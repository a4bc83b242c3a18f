"""`partitioner run --on-nonfinite skip|stop`, and `runtime.finite_step` for a script.

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

import torch

from .errors import NonFiniteError, PipelineError
from .scaler import agree

__all__ = ["CHOICES", "finite_step", "is_finite"]

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
