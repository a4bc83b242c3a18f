"""What the package records beside the graph and the plan (`codegen.PackageInfo`): the
model file, its inputs, the original state_dict's names, the prediction, the options."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from codegen import PackageInfo
from partitioner.cost.nodes import storage_key
from partitioner.predict.predict import rounded
from partitioner.ir import Plan
from partitioner.tp import Sharded
from partitioner.trace.inputs import output_batch_dims
from partitioner.trace.passes import get_attr
from partitioner.trace.siblings import sibling_modules
from partitioner.trace.trace import by_input_key
from runtime.manifest import ModelInput, Predicted

from .prepared import Prepared

__all__ = ["model_flops", "package_info"]


def model_flops(p: Prepared) -> int:
    """Forward FLOPs of one microbatch of the whole model (before any tensor split)."""
    costs = p.whole[1] if p.whole is not None else p.costs
    return sum(c.flops for c in costs.values())


def package_info(p: Prepared, plan: Plan, predicted: dict[str, Any]) -> PackageInfo:
    """The package's record of `p` compiled into `plan`, with the prediction `predicted`."""
    opts, mf, model, traced, hardware, sharded = p.opts, p.mf, p.model, p.traced, p.hardware, p.sharded
    batch, args, kwargs = p.batch, p.args, p.kwargs
    gm = traced.gm
    by_key = by_input_key(args, kwargs)
    dims = mf.leaf_batch_dims(model, args, kwargs)  # [Note: input leaves]
    inputs = []
    for node in (n for n in gm.graph.nodes if n.op == "placeholder"):
        key = dict(traced.input_keys)[node.name]
        value = by_key[key]
        meta = node.meta.get("tensor_meta")
        inputs.append(ModelInput(
            name=node.name, key=key, batch_dim=dims.get(key, 0),
            shape=tuple(int(d) for d in meta.shape) if meta is not None else None,
            dtype=str(value.dtype).replace("torch.", "") if isinstance(value, torch.Tensor) else None,
        ))
    graph_tensors = {str(n.target): get_attr(gm, str(n.target)) for n in gm.graph.nodes if n.op == "get_attr"}
    canonical = {storage_key(t): name for name, t in graph_tensors.items() if isinstance(t, torch.Tensor)}
    original = model.state_dict(keep_vars=True)
    aliases = {k: canonical[storage_key(t)] for k, t in original.items()
               if storage_key(t) in canonical and canonical[storage_key(t)] != k}
    unused = {k: t for k, t in original.items() if storage_key(t) not in canonical and k not in aliases}
    options = {"stages": plan.pp, "tp": plan.tp, "microbatches": plan.microbatches, "schedule": plan.schedule,
               "memory": opts.memory, "hardware": hardware.name, "analytic": opts.analytic,
               "optimizer": opts.optimizer} | _recompute_option(plan) \
        | ({"zero": 1} if opts.zero else {}) | ({"precision": opts.precision} if opts.precision != "fp32" else {}) \
        | ({"checkpointing": list(traced.checkpointed)} if traced.checkpointed else {}) \
        | ({"offload": opts.offload} if opts.offload != "auto" else {})
    return PackageInfo(
        source_path=Path(opts.model).name, source_sha256=mf.sha256, source_text=mf.text,
        source_modules=sibling_modules(opts.model), entry=opts.entry, seed=opts.seed, tracer=traced.tracer,
        batch_size=batch, inputs=tuple(inputs), out_spec=traced.out_spec, output_leaves=traced.output_leaves,
        persistent=set(original), aliases=aliases, unused={k: t.detach() for k, t in unused.items()},
        unused_params={k for k, t in unused.items() if isinstance(t, torch.nn.Parameter)},
        predicted=Predicted.from_dict(predicted) if predicted else None, options=options, tp=plan.tp,
        shards=dict(sharded.params) if sharded is not None else {},
        tensor_parallel=_tp_summary(sharded), recompute=plan.recompute, offload=plan.offload, free_batch=p.free_batch,
        precision=opts.precision, loss_reduction=p.loss_reduction,
        output_batch_dims=output_batch_dims(traced.output_leaves, p.rows, _input_dims_by_shape(inputs)),
    )


def _input_dims_by_shape(inputs: list[ModelInput]) -> dict[tuple[int, ...], int]:
    """The batch dim of each input tensor's microbatch shape (the last input of a shape wins)."""
    return {i.shape: i.batch_dim for i in inputs if i.shape is not None}


def _tp_summary(sharded: Sharded | None) -> dict[str, Any]:
    """The manifest's `tensor_parallel` block: the rule chosen per split node, the collectives."""
    if sharded is None:
        return {}
    report = sharded.report
    return {
        "degree": sharded.tp,
        "rules": dict(sorted(sharded.rules.items())),
        "collectives": sharded.collectives,
        "sharded_parameters": {k: str(v) for k, v in sorted(sharded.params.items())},
        "solver": {} if report is None else rounded({
            "method": report.method, "status": report.status, "objective_s": report.objective_s,
            "replicated_s": report.replicated_s, "lower_bound_s": report.lower_bound_s, "variables": report.variables}),
    }


def _recompute_option(plan: Plan) -> dict[str, Any]:
    """The manifest options' `recompute`: true where every stage recomputes in full (as
    before policies), each stage's policy where they differ, absent where none does."""
    if plan.recompute:
        return {"recompute": True}
    policies = [plan.policy(k) or "none" for k in range(plan.num_stages)]
    return {"recompute": policies} if plan.recomputes else {}
