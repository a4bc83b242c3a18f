"""`runtime.GradScaler`: torch.amp.GradScaler for `--precision fp16-mixed` pipelines; and
`runtime.finite_step` / `runtime.NonFiniteSteps` (`partitioner run --on-nonfinite skip|stop
--max-skips K`), which agree as it does.

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
    weight.  After the backward and before clipping (a non-finite norm would scale every
    gradient to nan), each rank looks at the loss (every rank holds it) and at the
    gradients of the parameters its optimizer updates, and the ranks agree by one
    all-reduce (MAX) of that flag (`scaler.agree`, as [Note: a global loss scale] does),
    so a step is taken on every rank or on none.  The flag says what was not finite (the loss outranks a
    gradient); for a gradient the ranks then gather the name of each one's first
    non-finite one, so every rank names the same parameter and rank.  skip: the gradients
    are zeroed and the caller takes neither the optimizer step nor the LR scheduler step
    (the batch is used up all the same); `NonFiniteSteps` skips at most `max_skips` steps
    in a row (`run --max-skips K`, default MAX_SKIPS), and the next one in a row stops
    the run, as a run whose every step is nan would otherwise go on for ever; stop:
    NonFiniteError names the step and what was not finite.  Under fp16-mixed only the
    loss is looked at: gradients that overflow are the GradScaler's, which skips those
    steps by itself.

    Usage (on every rank, in a script):
        steps = runtime.NonFiniteSteps("skip", max_skips=10, names=pipe.named_parameters())
        loss = pipe.train_step(x, y, loss_fn=loss_fn)
        if steps(loss, opt, step=k):          # or runtime.finite_step(loss, opt, step=k): one step alone
            opt.step()
            sched.step()
"""

from __future__ import annotations

import datetime
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from .errors import NonFiniteError, PipelineError

__all__ = ["GradScaler", "agree", "CHOICES", "MAX_SKIPS", "NonFiniteSteps", "finite_step", "is_finite", "not_finite"]


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
MAX_SKIPS = 10  # `--max-skips`' default: at most this many steps skipped in a row
_NAME_BYTES = 256  # a parameter's name as the ranks exchange it


def not_finite(loss: torch.Tensor, optimizer: torch.optim.Optimizer | None, grads: bool = True,
               timeout_s: float = 60.0, names: Iterable[tuple[str, torch.Tensor]] | None = None) -> str | None:
    """None when the loss and (with `grads`) the gradients are finite on EVERY rank; else
    what is not, the same on every rank: "the loss", or "the gradient of NAME on rank R"
    (the first such parameter of the lowest such rank; NAME from `names`, (name,
    parameter) pairs such as `pipe.named_parameters()`, else its place in the optimizer).
    Collective: one all-reduce, and one all-gather when only a gradient is not finite; a
    rank without parameters passes None."""
    timeout = datetime.timedelta(seconds=timeout_s)
    bad, name = _LOSS, ""
    if bool(torch.isfinite(loss.detach()).all()):
        name = _first_nonfinite_grad(optimizer, names) if grads else ""
        bad = _GRADIENT if name else _FINITE
    worst = int(agree(torch.tensor(float(bad), device=loss.device), timeout).item())
    if worst == _FINITE:
        return None
    if worst == _LOSS:
        return "the loss"
    held = _gather_names(name, timeout, loss.device)
    rank, first = next((r, n) for r, n in enumerate(held) if n)
    return f"the gradient of {first}" + (f" on rank {rank}" if len(held) > 1 else "")


_FINITE, _GRADIENT, _LOSS = 0, 1, 2  # each rank's flag; the largest wins


def _first_nonfinite_grad(optimizer: torch.optim.Optimizer | None,
                          names: Iterable[tuple[str, torch.Tensor]] | None) -> str:
    """The name of this rank's first parameter whose gradient is not finite, or ""."""
    if optimizer is None:
        return ""
    named = {id(p): n for n, p in names} if names is not None else {}
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
                return named.get(id(p), f"parameter {i} of the optimizer's group {g}")
    return ""


def _gather_names(name: str, timeout: datetime.timedelta, device: torch.device) -> list[str]:
    """Every rank's `name` (this rank's alone outside torch.distributed), by rank."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [name]
    data = list(name.encode()[:_NAME_BYTES])
    mine = torch.zeros(_NAME_BYTES, dtype=torch.uint8, device=device)
    mine[:len(data)] = torch.tensor(data, dtype=torch.uint8)
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine, async_op=True).wait(timeout)
    return [bytes(t.cpu().tolist()).rstrip(b"\0").decode(errors="replace") for t in out]


def is_finite(loss: torch.Tensor, optimizer: torch.optim.Optimizer | None, grads: bool = True,
              timeout_s: float = 60.0) -> bool:
    """Whether the loss and (with `grads`) the gradients are finite on EVERY rank
    (collective, as `not_finite`; a rank without parameters passes None)."""
    return not_finite(loss, optimizer, grads, timeout_s) is None


def finite_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer | None, step: int,
                on_nonfinite: str = "skip", grads: bool = True, timeout_s: float = 60.0,
                names: Iterable[tuple[str, torch.Tensor]] | None = None) -> bool:
    """True when the optimizer step may be taken ([Note: non-finite steps]); else, under
    "skip", the gradients are zeroed and False is returned (take no optimizer or scheduler
    step), under "stop" NonFiniteError names `step` and what was not finite.  One step
    alone: `NonFiniteSteps` also stops after too many skipped in a row.  Collective: call
    on every rank."""
    return NonFiniteSteps(on_nonfinite, max_skips=None, grads=grads, timeout_s=timeout_s, names=names)(
        loss, optimizer, step)


class NonFiniteSteps:
    """`finite_step` over a run, which stops it (NonFiniteError) when more than
    `max_skips` steps in a row are not finite under "skip" (None: never); `skipped`
    says what was not finite in the step just skipped ([Note: non-finite steps])."""

    def __init__(self, on_nonfinite: str = "skip", max_skips: int | None = MAX_SKIPS, grads: bool = True,
                 timeout_s: float = 60.0, names: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
        if on_nonfinite not in CHOICES:
            raise PipelineError(f"on_nonfinite={on_nonfinite!r}: give one of {', '.join(CHOICES)}.")
        if max_skips is not None and max_skips < 0:
            raise PipelineError(f"max_skips={max_skips}: give how many steps in a row may be skipped, 0 or more.")
        self.on_nonfinite, self.max_skips, self.grads, self.timeout_s = on_nonfinite, max_skips, grads, timeout_s
        self.names = list(names) if names is not None else None
        self.in_a_row = 0  # steps skipped in a row, up to the last one
        self.skipped: str | None = None  # what was not finite in the step just skipped

    def __call__(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer | None, step: int) -> bool:
        """True when step `step` may be taken; False when it is skipped (its gradients
        zeroed); NonFiniteError when the run stops here.  Collective."""
        what = not_finite(loss, optimizer, self.grads, self.timeout_s, self.names)
        self.skipped = None
        if what is None:
            self.in_a_row = 0
            return True
        found = (f"{what} ({loss.item():g}) is not finite (nan or inf)" if what == "the loss"
                 else f"{what} is not finite (nan or inf), though the loss ({loss.item():g}) is")
        if self.on_nonfinite == "stop":
            raise NonFiniteError(f"step {step}: {found}, and --on-nonfinite stop ends the "
                                 f"run here (no weight was changed by this step): look at the data of step {step} "
                                 f"(the model file's batches()) and the learning rate, resume from the last "
                                 f"checkpoint, or pass --on-nonfinite skip to skip such steps on every rank.")
        if self.max_skips is not None and self.in_a_row >= self.max_skips:
            first = step - self.in_a_row
            raise NonFiniteError(f"step {step}: {found}, nor was any step since step "
                                 f"{first}: {self.in_a_row + 1} in a row, more than --max-skips {self.max_skips} "
                                 f"allows, so the run stops here (no weight was changed by steps {first}-{step}): look "
                                 f"at the data of those steps (the model file's batches()) and the learning rate, "
                                 f"resume from the last checkpoint, or raise --max-skips.")
        self.in_a_row += 1
        self.skipped = what
        if optimizer is not None:
            optimizer.zero_grad()
        return False
