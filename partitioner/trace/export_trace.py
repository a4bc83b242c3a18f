"""The export tracer: `torch.export.export(strict=False)`, then `ExportedProgram.module()`,
which un-lifts parameters back into `get_attr` nodes (Hugging Face models need this one)."""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import warnings
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from ..errors import TraceError
from .autocast import refuse_autocast
from .functions import recorded_functions, short_name
from .inputs import InputKey, leaves_of, path_entry, tops
from .kept import rewrite_kept_export, stubbed_for_export
from .outputs import registering_outputs
from .passes import inline_higher_order
from .traced import Traced

__all__ = ["trace_export"]


def _dynamic_shapes(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                    batch_dims: dict[InputKey, int] | None) -> dict[str, Any] | None:
    """export's `dynamic_shapes`: each tensor input's batch dimension left to export
    (`Dim.AUTO`: dynamic where the model allows it, else specialised, which the probes of
    [Note: free batch] then find).  None where forward's `**kwargs` takes a keyword: export
    cannot match dynamic shapes to one (torch 2.x asserts), so the batch is the example's."""
    names = [p.name for p in inspect.signature(model.forward).parameters.values()]
    if batch_dims is None or any(key not in names for key in kwargs):
        return None
    spec: dict[str, Any] = {}
    for key, value in tops(args, kwargs):
        name = names[key] if isinstance(key, int) else str(key)
        leaves = [(_dynamic_dim(leaf, batch_dims.get(k, 0))) for k, leaf in leaves_of(key, value)]
        spec[name] = pytree.tree_unflatten(leaves, pytree.tree_flatten(value)[1])
    return spec


def _dynamic_dim(value: Any, dim: int) -> dict[int, Any] | None:
    """export's dynamic_shapes entry of one input leaf: its batch dim left to export."""
    return {dim: torch.export.Dim.AUTO} if isinstance(value, torch.Tensor) and value.dim() > dim else None


def trace_export(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                  batch_dims: dict[InputKey, int] | None = None, kept: dict[str, str] | None = None) -> Traced:
    """The torch.export trace of `model(*args, **kwargs)`, un-lifted into an fx graph; the
    dimensions of `batch_dims` left to export ([Note: free batch]); the submodules of `kept`
    (path -> why) kept whole as calls ([Note: kept whole under export] in kept.py)."""
    # export logs and prints its own failures (graph dumps, tracebacks); the TraceError
    # we raise says what matters, so its output is silenced while it runs.
    logging.disable(logging.CRITICAL)
    called: list[str] = []
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            with recorded_functions(called), stubbed_for_export(model, args, kwargs, list(kept or {})) as calls, \
                    registering_outputs(model):  # [Note: output classes] in outputs.py
                ep = torch.export.export(model, args, kwargs, strict=False,
                                         dynamic_shapes=_dynamic_shapes(model, args, kwargs, batch_dims))
    finally:
        logging.disable(logging.NOTSET)
    if called:
        raise TraceError(f"torch.export traces into custom autograd Function {short_name(called[0])}'s forward, which would "
                         f"lose its backward: make forward() traceable by torch.fx (--tracer fx), which keeps "
                         f"`{short_name(called[0])}.apply(...)` as one call the stage makes.")
    gm = ep.module()
    assert isinstance(gm, torch.fx.GraphModule)
    if kept:
        rewrite_kept_export(gm, model, calls, kept)
    regions = inline_higher_order(gm)
    if any(regions):  # an enabled region is refused at any precision, before the graph runs
        refuse_autocast(tuple(regions), "export", "fp32")
    flat, _ = pytree.tree_flatten_with_path((args, kwargs))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(flat) != len(placeholders):
        raise TraceError(
            f"export flattened the inputs into {len(placeholders)} tensors but the example "
            f"batch has {len(flat)} leaves; pass each input as one tensor argument."
        )
    keys: list[tuple[str, InputKey]] = []
    for node, (path, _value) in zip(placeholders, flat):  # path: (args or kwargs, top key, *inside)
        entries = [path_entry(k) for k in path[1:]]
        keys.append((node.name, entries[0] if len(entries) == 1 else tuple(entries)))
    out = next(n for n in gm.graph.nodes if n.op == "output")
    leaves = list(out.args[0])
    spec = ep.call_spec.out_spec
    assert spec is not None
    return Traced(gm, "export", keys, spec, leaves, tuple(regions), dict(kept or {}))
