"""The numeric precision a package trains in (`compile --precision`, the manifest's `precision`).

[Note: mixed precision]
    `bf16-mixed` is torch.autocast with bfloat16: parameters, gradients and optimizer
    state stay float32, matmuls and the ops autocast lists run in bfloat16.  The compile
    runs the graph under the same autocast as the runtime (`autocast` here), so the dtypes
    the manifest records for the values crossing stages, the bytes of their messages, the
    activation memory and the measured costs are those of the autocast run.  Each stage's
    forward and the loss run under it; backward follows the forward's dtypes as autograd
    does.  Autocast written inside the model is refused at compile time
    (`partitioner.trace.trace`): the traced graph cannot keep it.

[Note: bf16 with master weights]
    `bf16` computes in bfloat16 throughout: the compile casts the model (`cast_model`) and
    the floating inputs of its example batch to bfloat16 before tracing, so the stage
    files build bfloat16 parameters and buffers, the boundaries carry bfloat16 and every
    node is costed as it runs.  At run time the floating batch inputs are cast the same
    way (`StageRunner.forward`) and the loss is computed on the output cast to float32
    (`loss_input`), as Megatron-LM does.  Each pipeline keeps a float32 master copy of its
    parameters (`MasterWeights`): `pipe.parameters()`, `named_parameters()`,
    `make_optimizer`, `clip_grad_norm_`, `state_dict()`, `load_state_dict`, checkpoints
    and `init_weights` all see the masters, so the optimizer, its state and what is saved
    are float32.  A step computes bfloat16 gradients on the stage modules (summed over
    microbatches and reduced across replicas in bfloat16), then moves them onto the
    masters as float32 (`take_grads`, adding to what an earlier step left: gradient
    accumulation is float32); the next forward copies the masters into the bfloat16
    weights (`refresh`).  The unsplit model trained the same way keeps float32 masters of
    its parameters (`masters_for`, taken before `cast_model`) and makes the same calls
    around each step: tests/precision_reference.py.  Memory per parameter with Adam: 2 bytes of
    bfloat16 weight and 2 of its gradient during the step, then 4 of float32 gradient,
    4 of master and 8 of Adam's moments (the planner counts ZeRO's 16: 2 + 2 + 12).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Sequence, TypeVar

import torch
import torch.utils._pytree as pytree

__all__ = ["PRECISIONS", "autocast", "device_type", "cast_model", "cast_inputs", "loss_input",
           "MasterWeights", "masters_for", "shown"]

#: every --precision (`compile --precision`, the manifest's `precision`)
PRECISIONS = ("fp32", "bf16-mixed", "bf16", "fp16-mixed")

T = TypeVar("T")


def autocast(precision: str, device: str = "cpu") -> contextlib.AbstractContextManager[Any]:
    """The autocast context `precision` runs a forward under on a `device` type."""
    if precision == "bf16-mixed":
        return torch.autocast(device, dtype=torch.bfloat16)
    if precision == "fp16-mixed":  # with runtime.GradScaler ([Note: a global loss scale])
        return torch.autocast(device, dtype=torch.float16)
    return contextlib.nullcontext()


def device_type(values: Any) -> str:
    """The device type of the first tensor among `values` ("cpu" when none)."""
    for v in values:
        if isinstance(v, torch.Tensor):
            return v.device.type
    return "cpu"


def cast_model(model: torch.nn.Module, precision: str) -> torch.nn.Module:
    """`model` with its floating parameters and buffers in bfloat16 under `bf16` (in place,
    as `Module.to`); unchanged otherwise ([Note: bf16 with master weights])."""
    return model.to(torch.bfloat16) if precision == "bf16" else model


def cast_inputs(values: T, precision: str) -> T:
    """`values` (any pytree) with its float32 tensors in bfloat16 under `bf16`."""
    if precision != "bf16":
        return values
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(torch.bfloat16) if t.dtype == torch.float32 else t,
                                values)


def loss_input(output: T, precision: str) -> T:
    """What `loss_fn` is given of the model's output: under `bf16` its bfloat16 tensors as
    float32 (the loss and its gradient in float32), else the output itself."""
    if precision != "bf16":
        return output
    return pytree.tree_map_only(torch.Tensor, lambda t: t.float() if t.dtype == torch.bfloat16 else t, output)


class MasterWeights:
    """float32 master copies of bfloat16 parameters ([Note: bf16 with master weights]).

    `of(p)` is the master of stage parameter `p` (anything else is returned as is); the
    masters are what a pipeline shows its user.  `take_grads` moves the stage parameters'
    gradients onto the masters; `refresh` copies the masters into the stage parameters."""

    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        self._pairs: dict[int, tuple[torch.nn.Parameter, torch.nn.Parameter]] = {}
        for p in params:
            if id(p) not in self._pairs:
                self._pairs[id(p)] = (p, torch.nn.Parameter(p.detach().float(), requires_grad=p.requires_grad))

    def of(self, t: T) -> T:
        pair = self._pairs.get(id(t))
        return pair[1] if pair is not None else t  # type: ignore[return-value]

    @torch.no_grad()
    def take_grads(self) -> None:
        """Add each stage parameter's gradient, as float32, to its master's, and free it."""
        for p, master in self._pairs.values():
            if p.grad is not None:
                grad = p.grad.float()
                master.grad = grad if master.grad is None else master.grad.add_(grad)
                p.grad = None

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy every master into its stage parameter (rounded to bfloat16)."""
        for p, master in self._pairs.values():
            p.copy_(master)


K = TypeVar("K")


def shown(masters: MasterWeights | None, pairs: Sequence[tuple[K, T]]) -> list[tuple[K, T]]:
    """`(key, tensor)` pairs as the user sees them: each stage parameter replaced by its
    master when there are `masters`."""
    return list(pairs) if masters is None else [(key, masters.of(t)) for key, t in pairs]


def masters_for(params: Iterable[torch.nn.Parameter], precision: str) -> MasterWeights | None:
    """The master weights a pipeline of `precision` keeps of `params`: None unless `bf16`."""
    return MasterWeights(params) if precision == "bf16" else None
