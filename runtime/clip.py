"""Global gradient clipping: the norm `torch.nn.utils.clip_grad_norm_` computes on the
original model, from the pieces a pipeline's ranks (or LocalPipeline's lanes) hold.

[Note: counting each parameter once]
    After a step every copy of a parameter holds the same gradient: dp replicas (averaged,
    comm.GradBuckets), tied copies on several stages (summed, comm.TiedGrads / local._Tied),
    and a tensor-parallel replicated parameter on each tp rank.  The whole model's norm
    counts each original parameter once, so a holder counts a parameter only where

        replica == 0, the stage is the lowest one listing that source name, and
        the parameter is a tensor-parallel shard (shard.count > 1: every tp rank counts
        its own piece, the pieces' terms summed) or tp index == 0.

    For norm_type p the terms are sum(|g|^p) per holder, summed over the world, then ^(1/p);
    for inf they are max|g|, reduced by MAX.  Every gradient a holder has, counted or not, is
    then multiplied by the same coefficient, so the copies stay equal.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch

from .errors import PipelineError
from .manifest import Manifest

__all__ = ["NonFiniteNormError", "check_norm_type", "counted_names", "norm_term", "grad_dtype", "total_norm", "clip_"]


class NonFiniteNormError(PipelineError, RuntimeError):
    """The gradient norm is nan or inf and error_if_nonfinite was set (a RuntimeError, as torch raises)."""


def check_norm_type(norm_type: float) -> float:
    """The norm type as a float: p > 0 or inf (what a sum over ranks can reduce)."""
    p = float(norm_type)
    if not p > 0:
        raise PipelineError(f"clip_grad_norm_ got norm_type={norm_type!r}, which the pipeline cannot reduce across "
                            f"ranks: use a positive order (2.0 the default, 1.0, ...) or float('inf').")
    return p


def counted_names(manifest: Manifest, stages: Iterable[int], tp_index: int, replica: int) -> set[str]:
    """The source names whose gradients a holder of `stages` counts ([Note: counting each parameter once])."""
    if replica != 0:
        return set()
    first: dict[str, int] = {}
    sharded: set[str] = set()
    for stage in manifest.stages:
        for spec in stage.parameters:
            first[spec.source_name] = min(first.get(spec.source_name, stage.index), stage.index)
            if spec.shard.count > 1:
                sharded.add(spec.source_name)
    held = set(stages)
    return {n for n, s in first.items() if s in held and (tp_index == 0 or n in sharded)}


def norm_term(named: Sequence[tuple[str, torch.nn.Parameter]], counted: set[str], norm_type: float,
              device: torch.device) -> torch.Tensor:
    """This holder's term, as float64 [value, nan flag] on `device`: value is sum(|g|^p) over its
    counted gradients (or max|g| for inf, with the nan flag set when a norm is nan, which MAX
    would lose)."""
    seen: set[str] = set()  # a holder's copies of one parameter (tied, on several devices) count once
    norms = []
    for name, p in named:
        if name in counted and p.grad is not None and name not in seen:
            seen.add(name)
            norms.append(torch.linalg.vector_norm(p.grad.detach(), norm_type).to(device))
    if not norms:
        return torch.zeros(2, dtype=torch.float64, device=device)
    stacked = torch.stack(norms).double()
    if math.isinf(norm_type):
        nan = torch.isnan(stacked).any()
        return torch.stack([torch.nan_to_num(stacked, nan=0.0).max(), nan.float()])
    return torch.stack([stacked.pow(norm_type).sum(), torch.zeros((), dtype=torch.float64, device=device)])


def grad_dtype(params: Iterable[torch.nn.Parameter]) -> torch.dtype:
    """The dtype torch's norm has: the first gradient's (float32 when there is none)."""
    return next((p.grad.dtype for p in params if p.grad is not None), torch.float32)


def total_norm(reduced: torch.Tensor, norm_type: float, dtype: torch.dtype) -> torch.Tensor:
    """The whole model's norm from the terms reduced over every holder (SUM, or MAX for inf)."""
    value = reduced[0] if math.isinf(norm_type) else reduced[0].pow(1.0 / norm_type)
    if math.isinf(norm_type) and bool(reduced[1] > 0):
        value = torch.full_like(value, math.nan)
    return value.to(dtype)


def clip_(params: Iterable[torch.nn.Parameter], total: torch.Tensor, max_norm: float, norm_type: float,
          error_if_nonfinite: bool) -> None:
    """Raise as torch does on a non-finite norm when asked; else scale every gradient by
    min(1, max_norm / (total + 1e-6)), as torch.nn.utils.clip_grad_norm_ does."""
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise NonFiniteNormError(f"The total norm of order {norm_type} for gradients from `parameters` is "
                                 f"non-finite, so it cannot be clipped. To disable this error and scale the "
                                 f"gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    seen: set[int] = set()
    for p in params:
        if p.grad is not None and id(p) not in seen:
            seen.add(id(p))
            p.grad.detach().mul_(coef.to(p.grad.device, p.grad.dtype))
