"""Trace: the user's unmodified model -> one `torch.fx.GraphModule`.

Two tracers give the same form of graph, which the rest of the compiler consumes unchanged:

- `fx`: `torch.fx` symbolic tracing that goes *through* every module (no leaf modules), so
  parameters are `get_attr` nodes named by their original fully-qualified names and all
  compute is `call_function` / `call_method`.
- `export`: `torch.export.export(strict=False)`, then `ExportedProgram.module()`, which
  un-lifts parameters back into `get_attr` nodes.  Hugging Face models need this one.

The tracers live in fx_trace.py and export_trace.py, what a failure says in messages.py,
the `Traced` they return in traced.py.  `auto` tries fx, then export.  When every tracer fails, the `TraceError` names the line of
the user's model file that broke tracing.

The graph is traced for ONE MICROBATCH (export specialises shapes) and its output is
described by a pytree `TreeSpec` over the output leaves, so codegen can rebuild the very
structure the model returns (a tensor, a tuple, a dict, a Hugging Face ModelOutput).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.fx

from ..errors import TraceError
from .autocast import AutocastRefused, refuse_autocast
from .checkpointing import inlined_checkpoints
from .export_trace import trace_export
from .fx_trace import _ThroughTracer, trace_fx
from .grad_mode import keep_no_grad
from .inputs import InputKey, expand_outputs
from .kept import failing_submodule, module_line
from .messages import failure_message, library_frame
from .model_file import user_frame
from .passes import Repeating
from .state import StateUpdatedWhileTracing
from .traced import Traced, by_input_key, copy_traced

# _ThroughTracer: re-exported for tests that time fx's own name lookup against it
__all__ = ["Traced", "by_input_key", "check_autocast", "copy_traced", "trace", "TRACERS", "_ThroughTracer"]

TRACERS = ("auto", "fx", "export")


def trace(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    tracer: str = "auto",
    model_path: str = "",
    batch_dims: dict[InputKey, int] | None = None,
) -> Traced:
    """Trace `model` called as `model(*args, **kwargs)` into an fx graph; with
    `batch_dims` (input key -> dim), export leaves those dimensions dynamic ([Note: free batch])."""
    if tracer not in TRACERS:
        raise TraceError(f"unknown --tracer {tracer!r}: choose one of {', '.join(TRACERS)}.")
    order = ["fx", "export"] if tracer == "auto" else [tracer]
    failures: list[tuple[str, BaseException]] = []
    was_training = model.training
    model.train()  # the training branches are traced ([Note: modes in generated code] in modes.py)
    try:
        with inlined_checkpoints(model) as checkpointed:  # [Note: the user's checkpointing]
            for name in order:
                try:
                    traced = trace_fx(model, args, kwargs) if name == "fx" else trace_export(model, args, kwargs, batch_dims)
                    traced = _check_runs(traced, model, args, kwargs)
                    return dataclasses.replace(traced, checkpointed=tuple(checkpointed))
                except AutocastRefused:
                    raise
                except StateUpdatedWhileTracing as updated:  # export records it ([Note: state updated outside the graph])
                    if tracer == "fx":
                        raise
                    failures.append((name, updated))
                except Exception as exc:  # every tracer failure is reported together below
                    failures.append((name, exc))
            for name, failure in failures:
                kept = _trace_keeping_whole(model, args, kwargs, failure, model_path, name, batch_dims)
                if kept is not None:
                    return dataclasses.replace(kept, checkpointed=tuple(checkpointed))
    finally:
        model.train(was_training)
    raise TraceError(failure_message(failures, model_path))


#: how many submodules one trace may keep whole before giving up
MAX_KEPT = 32


def _trace_keeping_whole(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], exc: BaseException,
                         model_path: str, tracer: str, batch_dims: dict[InputKey, int] | None) -> Traced | None:
    """`tracer` again with the submodule that broke tracing kept whole, as often as it helps
    (partitioner.trace.kept); None when the failure is in the top-level module itself (fx
    fails there on a Hugging Face model's decorated forward; export then keeps its dynamic
    RoPE whole)."""
    reasons: dict[str, str] = {}
    for _ in range(MAX_KEPT):
        path = failing_submodule(exc, model)
        if not path or path in reasons:
            return None
        where = user_frame(exc, model_path, Path(model_path).name).strip() if model_path else ""
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        inside = library_frame(exc, model_path) if tracer == "fx" else ""  # export's own frames say nothing
        line = where.removeprefix("at ") or module_line(exc, model.get_submodule(path))
        reasons[path] = (line + (f", inside{inside}" if inside and where else "") + f": {first[:120]}") if line else first[:160]
        try:
            traced = (trace_fx(model, args, kwargs, reasons) if tracer == "fx"
                      else trace_export(model, args, kwargs, batch_dims, reasons))
            return _check_runs(traced, model, args, kwargs)
        except Exception as again:  # the next module to keep whole, or give up
            exc = again
    return None




def check_autocast(traced: Traced, precision: str) -> None:
    """Refuse a model that enters torch.autocast itself where dropping it would change what
    it computes ([Note: mixed precision] in runtime/precision.py): an enabled region always,
    a disabled one unless the whole model runs in fp32 (where it is a no-op)."""
    refuse_autocast(traced.autocast, traced.tracer, precision)



def _check_runs(traced: Traced, model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Traced:
    """The graph must run on the example inputs (it is run again, timed, later); returns
    `traced` with every output leaf one tensor (`inputs.expand_outputs`)."""
    by_key = by_input_key(args, kwargs)
    flat = [by_key[key] for _name, key in traced.input_keys]
    with torch.no_grad():
        traced.gm.graph.lint()
        run = Repeating(traced.gm, garbage_collect_values=False)  # [Note: repeated ops on the meta device]
        _ = run.run(*flat)
    keep_no_grad(traced.gm, run.env, aten=traced.tracer == "export")  # [Note: no_grad regions]
    return expand_outputs(traced, run.env)
