"""Recomputation policies: which ops a recomputing stage keeps and which it runs again.

[Note: recomputation policies]
    A stage's `recompute` policy (the manifest's stage entry, the plan's `StagePlan`):

    - none: autograd keeps every tensor the backward needs, for each microbatch in flight.
    - full: the training forward runs under torch.utils.checkpoint; a microbatch in flight
      keeps only the stage's inputs, and its whole forward runs again in its backward.
    - selective (Korthikanti et al., "Reducing activation recomputation in large
      transformer models", MLSys 2023): the same checkpoint, with a policy
      (torch.utils.checkpoint.create_selective_checkpoint_contexts) that keeps the
      outputs of the ops in `SAVED_OPS` (matmuls, convolutions, fused attention: costly
      to redo, small to keep) and runs every other op again (softmax, dropout, the
      activation functions, elementwise ops, views, norms: cheap to redo, large to keep).

    A selective region may run its backward once only (its kept outputs are handed over
    once), so under a schedule that splits the backward ([Note: split backward] in
    stage.py) a selective stage's I runs the whole backward, weights' gradients too, and
    its W has nothing left to do: the same gradients, the weights' share of the time
    moved from W to I.

    The ops are named by their base name (`op_name`): the planner classifies the traced
    graph's nodes by the same table (partitioner/cost/recompute.py), so what it counts as
    kept is what the runtime keeps.  Checkpointing keeps the RNG state its forward started
    with, so a recomputed dropout draws the same mask ([Note: dropout streams] in
    modes.py): both policies train exactly like the plain forward.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch.utils.checkpoint as checkpoint

__all__ = ["POLICIES", "SAVED_OPS", "op_name", "parse_policy", "run_checkpointed", "saves"]

#: the policies a stage may have; None in a StageSpec or StagePlan is "none"
POLICIES = ("none", "selective", "full")

#: the ops whose outputs selective recomputation keeps ([Note: recomputation policies])
SAVED_OPS = frozenset({
    "linear", "matmul", "mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "einsum", "bilinear",
    "conv1d", "conv2d", "conv3d", "convolution", "_convolution", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward", "_efficient_attention_forward",
})


def op_name(target: Any) -> str:
    """An op's base name: `aten.addmm.default` and `torch.addmm` are both "addmm"; a method
    name stays as it is; a trailing in-place `_` is dropped."""
    name = str(target if isinstance(target, str) else getattr(target, "_opname", None) or getattr(target, "__name__", ""))
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


def saves(target: Any) -> bool:
    """Whether selective recomputation keeps the output of an op with this target."""
    return op_name(target) in SAVED_OPS


def parse_policy(value: bool | str | None) -> str | None:
    """A policy as plans and stages hold it: None (none), "full" or "selective"; the old
    manifest's `true` is "full"."""
    if value is True:
        return "full"
    if value is None or value is False or value == "none":
        return None
    if value not in POLICIES:
        raise ValueError(f"recompute policy {value!r}: expected one of {', '.join(POLICIES)}")
    return str(value)


def _keep_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> checkpoint.CheckpointPolicy:
    del ctx, args, kwargs
    return checkpoint.CheckpointPolicy.MUST_SAVE if saves(op) else checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


def run_checkpointed(module: Callable[..., Any], args: list[Any], policy: str) -> Any:
    """`module(*args)` under torch.utils.checkpoint (non-reentrant), all of it recomputed
    ("full") or all but `SAVED_OPS` ("selective")."""
    if policy == "selective":
        context = functools.partial(checkpoint.create_selective_checkpoint_contexts, _keep_matmuls)
        return checkpoint.checkpoint(module, *args, use_reentrant=False, context_fn=context)
    return checkpoint.checkpoint(module, *args, use_reentrant=False)
