"""`pipe.make_optimizer`: a torch.optim optimizer over this process's parameters, with
parameter groups given by the ORIGINAL model's names.

[Note: parameter groups by original name]
    `params` is what a torch user would pass, with names where torch takes tensors:
      None                      one group of every parameter;
      a list of dicts           [{"params": [original names], **options}, ...], as
                                torch.optim takes [{"params": tensors, ...}];
      a callable                name -> dict of options for that parameter ({} for the
                                defaults); parameters with equal options share a group.
    Every process builds the SAME list of groups, in the same order, from the manifest
    (all names, not only its own): a group whose parameters sit on other ranks is empty
    here.  So group i means the same thing on every rank, and an LR scheduler (or
    `opt.param_groups[i]["lr"] = ...`) acts alike everywhere.  Each parameter is in exactly
    one group: a name in two groups, a name the model does not have, or a parameter in
    none is an `OptimizerError` (torch would leave an unlisted parameter untrained without
    a word).  Each copy of a parameter (tp replicas, tied copies, dp replicas) gets the
    same gradient, so the same update: copies stay equal, as the contract requires.

[Note: ZeRO-1]
    A package compiled with `--zero 1` (manifest options "zero": 1) and dp > 1 gets, on
    DistributedPipeline, torch's ZeroRedundancyOptimizer over this rank's data-parallel
    group (the replicas of its shards): the gradients are all-reduced as always
    (comm.GradBuckets), each replica keeps the optimizer state of its part of the
    parameters only (whole parameters, balanced by size) and updates it, and each part is
    then broadcast from its owner.  The update of each parameter is the one the plain
    optimizer computes, so the weights are the same.  The planner charges 1/dp of the
    optimizer state per rank (partitioner/solve/problem.pose) and the broadcast to the
    step (partitioner/predict/predict.zero_broadcast_s); without --zero, the mesh search
    of --devices turns it on for a mesh that fits in memory only so (driver/search.py).
    LocalPipeline holds one copy of each parameter for all replicas, so there is nothing
    to shard there.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence, Union

import torch

from .errors import PipelineError
from .manifest import Manifest

__all__ = ["OptimizerError", "ParamGroups", "model_names", "make_optimizer", "zero_stage"]

ParamGroups = Union[None, Sequence[Mapping[str, Any]], Callable[[str], Mapping[str, Any]]]


class OptimizerError(PipelineError):
    """make_optimizer's parameter groups do not match the model's parameters."""


def model_names(manifest: Manifest) -> list[str]:
    """Every parameter's original name once, in stage order."""
    names: dict[str, None] = {}
    for stage in manifest.stages:
        for spec in stage.parameters:
            names.setdefault(spec.source_name, None)
    return list(names)


def zero_stage(manifest: Manifest) -> int:
    """The ZeRO stage the package was compiled for (`compile --zero`): 0 or 1."""
    zero = manifest.options.get("zero", 0)
    if zero not in (0, 1) or isinstance(zero, bool):
        raise OptimizerError(f"the manifest's options say zero={zero!r}, which this runtime does not know (0 or 1): "
                             f"compile the model again.")
    return int(zero)


def make_optimizer(cls: type[torch.optim.Optimizer], named: Sequence[tuple[str, torch.nn.Parameter]],
                   manifest: Manifest, params: ParamGroups = None, shard_group: Any = None,
                   **defaults: Any) -> torch.optim.Optimizer:
    """`cls(groups, **defaults)` over `named` (this process's (original name, parameter)
    pairs, a name once per copy it holds) with groups from `params` ([Note: parameter groups
    by original name]); with a `shard_group`, its state sharded across that group ([Note: ZeRO-1])."""
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise OptimizerError(f"make_optimizer takes an optimizer class such as torch.optim.AdamW, not {cls!r}.")
    names = model_names(manifest)
    groups = _groups(params, names)
    where = {n: k for k, (group_names, _) in enumerate(groups) for n in group_names}
    tensors: list[list[torch.nn.Parameter]] = [[] for _ in groups]
    seen: set[int] = set()
    for name, p in named:
        if id(p) not in seen:
            seen.add(id(p))
            tensors[where[name]].append(p)
    param_groups = [{**options, "params": ps} for (_, options), ps in zip(groups, tensors)]
    if shard_group is not None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(param_groups, optimizer_class=cls, process_group=shard_group, **defaults)
    return cls(param_groups, **defaults)


def _groups(params: ParamGroups, names: list[str]) -> list[tuple[list[str], dict[str, Any]]]:
    """(names, options) per group, the same on every process."""
    if params is None:
        return [(names, {})]
    if callable(params):
        by_options: dict[str, tuple[list[str], dict[str, Any]]] = {}
        for n in names:
            options = dict(params(n))
            by_options.setdefault(repr(sorted(options.items())), ([], options))[0].append(n)
        return list(by_options.values())
    if isinstance(params, (str, bytes)) or not isinstance(params, Sequence):
        raise OptimizerError(f"make_optimizer's params is a {type(params).__name__}: give a list of dicts "
                             f"[{{'params': [original names], ...options}}], a function name -> options, or None.")
    return _listed(params, names)


def _listed(params: Sequence[Mapping[str, Any]], names: list[str]) -> list[tuple[list[str], dict[str, Any]]]:
    known, owner, out = set(names), dict[str, int](), list[tuple[list[str], dict[str, Any]]]()
    for k, group in enumerate(params):
        listed = group.get("params") if isinstance(group, Mapping) else None
        if listed is None or isinstance(listed, str) or not all(isinstance(n, str) for n in listed):
            raise OptimizerError(f"make_optimizer's parameter group {k} must be a dict whose 'params' is a list of "
                                 f"the original model's parameter names (e.g. {names[:2]}), got {group!r:.200}.")
        unknown = [n for n in listed if n not in known]
        if unknown:
            raise OptimizerError(f"parameter group {k} names {unknown[:5]}, which the model does not have: use names "
                                 f"from the original model's named_parameters() (e.g. {names[:3]}).")
        for n in listed:
            if n in owner:
                raise OptimizerError(f"{n!r} is in parameter groups {owner[n]} and {k}: list each parameter once.")
            owner[n] = k
        out.append((list(listed), {key: v for key, v in group.items() if key != "params"}))
    missing = [n for n in names if n not in owner]
    if missing:
        raise OptimizerError(f"{len(missing)} parameter(s) are in no group ({', '.join(missing[:5])}"
                             f"{', ...' if len(missing) > 5 else ''}): add them to a group (torch would leave them "
                             f"untrained without a word).")
    return out
