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
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = ["PRECISIONS", "BUILT", "autocast", "device_type"]

#: every --precision the contract names, and those built so far
PRECISIONS = ("fp32", "bf16-mixed", "bf16", "fp16-mixed")
BUILT = ("fp32", "bf16-mixed", "fp16-mixed")


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
