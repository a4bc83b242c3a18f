"""What the loss costs the last stage: the model file's `loss_fn` on one microbatch's output.

The traced graph ends at the model's output; the runtime's last stage then runs
`loss_fn(output, target)` forward and backward for every microbatch.  For a language
model with a large vocabulary that is the logits' log-softmax and its gradient, passes
over a (rows x length x vocabulary) tensor that can cost as much as a transformer layer
and keeps a copy of the logits alive until the backward.  `loss_cost` is that work as a
`NodeCost`: measured (timed as a stage times its forward and backward, by the timer of
the output's device, FLOPs from `torch.utils.flop_counter`, saved bytes from
`saved_tensors_hooks`, the allocator's peak where the device counts it) where the output
is real, else the roofline of a few passes over the output.  The solver adds it to the block
that holds the graph's output, which always lies in the last stage (`solve.problem`), and
the step simulator to the last stage's forward and backward (`predict.simulate_plan`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from ..ir import NodeCost
from .calibrate import forward_backward, time_forward_backward
from .hardware import Hardware
from .nodes import is_shape_only, storage_key
from .roofline import roofline_s
from .timer import CPU_TIMER, DeviceTimer

__all__ = ["LOSS_NODE", "loss_cost"]

#: the name the loss's cost goes by (no graph node has it: fx names are identifiers)
LOSS_NODE = "<loss>"

#: passes over the output an analytic loss makes: read it, write and read its log-softmax
_PASSES = 3
#: FLOPs per output element of a softmax cross-entropy (max, subtract, exp, sum, log)
_FLOPS_PER_ELEMENT = 5


def loss_cost(loss_fn: Callable[[Any, Any], torch.Tensor], output: Any, target: Any, hardware: Hardware,
              measure: bool, repeats: int, timer: DeviceTimer = CPU_TIMER) -> NodeCost:
    """One microbatch's loss forward and backward on `output` (the model's output, as the
    last stage returns it) against `target`, measured with `timer` (the output's device's)."""
    floats = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    out_bytes = sum(t.numel() * t.element_size() for t in floats)
    if measure and floats and not any(is_shape_only(t) for t in floats):
        return _measured(loss_fn, output, target, repeats, out_bytes, timer)
    elements = sum(t.numel() for t in floats)
    flops = _FLOPS_PER_ELEMENT * elements
    rate = hardware.peak_for(floats[0].dtype if floats else None)  # [Note: a peak per dtype] in hardware.py
    once = roofline_s(flops, _PASSES * out_bytes, rate, hardware.memory_bandwidth)
    return NodeCost(LOSS_NODE, forward_s=once, backward_s=once, flops=flops, activation_bytes=out_bytes)


def _measured(loss_fn: Callable[[Any, Any], torch.Tensor], output: Any, target: Any, repeats: int,
              out_bytes: int, timer: DeviceTimer) -> NodeCost:
    def fresh() -> Any:  # the output as the last stage holds it: a leaf that needs a gradient
        return pytree.tree_map_only(torch.Tensor, lambda t: t.detach().requires_grad_(t.is_floating_point()), output)

    inputs = fresh()
    held = {storage_key(t) for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in held:  # the output itself is the stage's, counted already
            saved[key] = max(saved.get(key, 0), t.numel() * t.element_size())
        return t

    counter = FlopCounterMode(display=False)
    with counter, torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn(inputs, target)
    forward_s, backward_s = time_forward_backward(lambda: loss_fn(fresh(), target), max(3, repeats), timer=timer)
    peak = timer.peak_bytes(lambda: forward_backward(lambda: loss_fn(fresh(), target))) if timer.counts_memory else None
    return NodeCost(LOSS_NODE, forward_s=forward_s, backward_s=backward_s, flops=int(counter.get_total_flops()),
                    activation_bytes=sum(saved.values()), output_bytes=0, peak_bytes=peak)
