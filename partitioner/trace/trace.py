"""Trace: the user's unmodified model -> one `torch.fx.GraphModule`.

Two tracers give the same form of graph, which the rest of the compiler consumes unchanged:

- `fx`: `torch.fx` symbolic tracing that goes *through* every module (no leaf modules), so
  parameters are `get_attr` nodes named by their original fully-qualified names and all
  compute is `call_function` / `call_method`.
- `export`: `torch.export.export(strict=False)`, then `ExportedProgram.module()`, which
  un-lifts parameters back into `get_attr` nodes.  Hugging Face models need this one.

`auto` tries fx, then export.  When every tracer fails, the `TraceError` names the line of
the user's model file that broke tracing.

The graph is traced for ONE MICROBATCH (export specialises shapes) and its output is
described by a pytree `TreeSpec` over the output leaves, so codegen can rebuild the very
structure the model returns (a tensor, a tuple, a dict, a Hugging Face ModelOutput).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import logging
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection

import torch
import torch.fx
import torch.utils._pytree as pytree

from ..errors import TraceError
from .autocast import AutocastRefused, recording_autocast, refuse_autocast
from .checkpointing import inlined_checkpoints
from .functions import functions_as_leaves, recorded_functions, short_name
from .inputs import (InputKey, expand_outputs, fix_placeholder, flat_codegen, flat_inputs, leaves_of,
                     nested_placeholders, path_entry, tops)
from .kept import failing_submodule, rewrite_kept
from .model_file import user_frame
from .passes import inline_higher_order

__all__ = ["Traced", "by_input_key", "check_autocast", "copy_traced", "trace", "TRACERS"]

TRACERS = ("auto", "fx", "export")


@dataclass
class Traced:
    """A traced model: its graph, which tracer made it, and how inputs/outputs map."""

    gm: torch.fx.GraphModule
    tracer: str
    #: for each placeholder, in graph order: its name and the user's key
    #: (an int for a positional argument, a str for a keyword argument)
    input_keys: list[tuple[str, InputKey]]
    #: the structure of the model's output over `output_leaves`
    out_spec: pytree.TreeSpec
    output_leaves: list[Any]
    #: the `enabled` flag of each torch.autocast region the model enters in forward(),
    #: which the graph does not keep (`check_autocast`)
    autocast: tuple[bool, ...] = ()
    #: submodules kept whole (partitioner.trace.kept): dotted path -> the line that broke tracing
    kept: dict[str, str] = field(default_factory=dict)
    #: the regions the model runs under torch.utils.checkpoint, by module path, traced as
    #: the ops they run ([Note: the user's checkpointing])
    checkpointed: tuple[str, ...] = ()


class _ThroughTracer(torch.fx.Tracer):
    """An fx tracer with no leaf modules: every nn.Module is traced into.

    A module attribute that is a parameter (or buffer) becomes a `get_attr` node named by
    the first name `named_parameters()` (`named_buffers()`) gives it, as fx does; fx finds
    that name by scanning every parameter on each access, which is quadratic in the
    parameters (seconds for GPT-3's 96 layers), so the names are looked up in a table.
    """

    _names: tuple[int, dict[int, str], dict[int, str]] | None = None

    def __init__(self, leaves: Collection[str] = ()) -> None:
        super().__init__()
        self.leaves = set(leaves)  # submodules kept whole
    #: a buffer read in forward is a get_attr of its name, never a constant of its value at
    #: trace time (`self.cval.clone()` would be frozen into the stage's code)
    proxy_buffer_attributes = True

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.leaves

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        if not isinstance(attr_val, torch.Tensor):
            return attr_val
        params, buffers = self._tables()
        name = params.get(id(attr_val)) if isinstance(attr_val, torch.nn.Parameter) else None
        if name is None and self.proxy_buffer_attributes:
            name = buffers.get(id(attr_val))
        if name is None:
            return attr_val
        if name not in parameter_proxy_cache:
            parameter_proxy_cache[name] = self.create_proxy("get_attr", name, (), {})
        return parameter_proxy_cache[name]

    def _tables(self) -> tuple[dict[int, str], dict[int, str]]:
        """id -> first name of every parameter and buffer of the traced root."""
        if self._names is None or self._names[0] != id(self.root):
            params: dict[int, str] = {}
            buffers: dict[int, str] = {}
            for n, p in self.root.named_parameters():
                params.setdefault(id(p), n)
            for n, b in self.root.named_buffers():
                buffers.setdefault(id(b), n)
            self._names = (id(self.root), params, buffers)
        return self._names[1], self._names[2]


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
                    traced = _trace_fx(model, args, kwargs) if name == "fx" else _trace_export(model, args, kwargs, batch_dims)
                    traced = _check_runs(traced, model, args, kwargs)
                    return dataclasses.replace(traced, checkpointed=tuple(checkpointed))
                except AutocastRefused:
                    raise
                except Exception as exc:  # every tracer failure is reported together below
                    failures.append((name, exc))
            kept = _trace_keeping_whole(model, args, kwargs, failures[0][1], model_path) if order[0] == "fx" else None
            if kept is not None:
                return dataclasses.replace(kept, checkpointed=tuple(checkpointed))
    finally:
        model.train(was_training)
    raise TraceError(_failure_message(failures, model_path))


#: how many submodules one trace may keep whole before giving up
MAX_KEPT = 32


def _trace_keeping_whole(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], exc: BaseException,
                         model_path: str) -> Traced | None:
    """fx again with the submodule that broke tracing kept whole, as often as it helps
    (partitioner.trace.kept); None when the failure is in the top-level module itself."""
    reasons: dict[str, str] = {}
    for _ in range(MAX_KEPT):
        path = failing_submodule(exc, model)
        if not path or path in reasons:
            return None
        where = user_frame(exc, model_path, Path(model_path).name).strip() if model_path else ""
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        inside = _library_frame(exc, model_path)
        reasons[path] = (f"{where.removeprefix('at ')}" + (f", inside{inside}" if inside else "") +
                         f": {first[:120]}") if where else first[:160]
        try:
            traced = _trace_fx(model, args, kwargs, reasons)
            return _check_runs(traced, model, args, kwargs)
        except Exception as again:  # the next module to keep whole, or give up
            exc = again
    return None


# -- fx ----------------------------------------------------------------------------------


def _trace_fx(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
              kept: dict[str, str] | None = None) -> Traced:
    params = list(inspect.signature(model.forward).parameters.values())
    given = {p.name: v for p, v in zip(params, args)} | kwargs
    # Arguments the example batch leaves out are fixed to their defaults, so `if mask is
    # None:` takes the branch the user's call takes rather than a proxy's.
    concrete = {
        p.name: p.default
        for p in params
        if p.name not in given
        and p.default is not inspect.Parameter.empty
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }
    nested = nested_placeholders(given)  # [Note: input leaves] in inputs.py
    with recording_autocast() as regions:
        graph = _traced_keeping_buffers(model, concrete | nested, kept or {})
    out_spec = flat_codegen(graph)
    for node in graph.nodes:  # a tensor default would be written as an unbound `_tensor_constant0`
        if node.op == "placeholder" and any(isinstance(a, (torch.Tensor, torch.fx.Node)) for a in node.args):
            node.args = ()
    gm = torch.fx.GraphModule(model, graph)
    # fx makes a placeholder for every parameter of forward(), in signature order (one per
    # leaf of a nested one); those fixed to their defaults are replaced by the default and
    # their guards dropped, and so are the non-tensor leaves of nested ones
    # ([Note: input leaves] in inputs.py).
    named = [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    placeholders = iter([n for n in gm.graph.nodes if n.op == "placeholder"])
    keys: list[tuple[str, InputKey]] = []
    for index, param in enumerate(named):
        top = index if index < len(args) else param.name
        if param.name in concrete:
            fix_placeholder(gm, next(placeholders), param.name, concrete[param.name], _default_value)
        elif param.name in nested:
            for key, leaf in leaves_of(top, given[param.name]):
                node = next(placeholders)
                if isinstance(leaf, torch.Tensor):
                    keys.append((node.name, key))
                else:
                    fix_placeholder(gm, node, param.name, leaf, _default_value)
        else:
            keys.append((next(placeholders).name, top))
    gm.recompile()
    if kept:
        rewrite_kept(gm, kept)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    if out_spec is not None:
        return Traced(gm, "fx", keys, out_spec, list(out.args[0]), tuple(regions), dict(kept or {}))
    leaves, spec = pytree.tree_flatten(_plain(out.args[0]))
    return Traced(gm, "fx", keys, spec, leaves, tuple(regions), dict(kept or {}))


def check_autocast(traced: Traced, precision: str) -> None:
    """Refuse a model that enters torch.autocast itself where dropping it would change what
    it computes ([Note: mixed precision] in runtime/precision.py): an enabled region always,
    a disabled one unless the whole model runs in fp32 (where it is a no-op)."""
    refuse_autocast(traced.autocast, traced.tracer, precision)


def _traced_keeping_buffers(model: torch.nn.Module, concrete: dict[str, Any], kept: dict[str, str]) -> torch.fx.Graph:
    """The fx graph of `model`; a buffer the forward rebinds (`self.steps += 1` assigns the
    in-place result back, a Proxy while tracing) is put back as it was."""
    owners = [(path, m, name, b) for path, m in model.named_modules() for name, b in m._buffers.items()]
    tracer, inlined = _ThroughTracer(kept), list[str]()
    try:
        with functions_as_leaves(tracer, inlined):
            graph = tracer.trace(model, concrete_args=concrete or None)
    finally:
        rebound = [f"{path}.{name}".lstrip(".") for path, m, name, b in owners if m._buffers.get(name) is not b]
        for _path, module, name, buffer in owners:
            module._buffers[name] = buffer
    if inlined:
        raise TraceError(f"the forward of custom autograd Function {short_name(inlined[0])} was traced into, which would "
                         f"lose its backward: call `{short_name(inlined[0])}.apply(...)` in forward() itself (not an alias "
                         f"of it taken at import), so that the stage calls it whole.")
    if rebound:
        raise TraceError(f"forward() assigns to buffer {rebound[0]} (`self.{rebound[0].split('.')[-1]} = ...` or "
                         f"`+=` on it), which torch.fx cannot record; torch.export can (--tracer export or auto).")
    return graph


def _default_value(gm: torch.fx.GraphModule, node: torch.fx.Node, name: str, value: Any) -> Any:
    """What replaces the placeholder of an argument fixed to its default: the value itself,
    or for a tensor (`shift=torch.tensor(0.25)`) a get_attr of a non-persistent buffer
    `_default_<name>` holding it (fx would write it as an unbound `_tensor_constant0`)."""
    if not isinstance(value, torch.Tensor):
        return value
    attr = f"_default_{name}"
    gm.register_buffer(attr, value, persistent=False)
    with gm.graph.inserting_before(node):
        return gm.graph.get_attr(attr)


def _plain(value: Any) -> Any:
    """fx's immutable_dict / immutable_list as the dict / list the model returned."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if type(value) is tuple:
        return tuple(_plain(v) for v in value)
    return value


# -- export ------------------------------------------------------------------------------


def _dynamic_shapes(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                    batch_dims: dict[InputKey, int] | None) -> dict[str, Any] | None:
    """export's `dynamic_shapes`: each tensor input's batch dimension left to export
    (`Dim.AUTO`: dynamic where the model allows it, else specialised, which the probes of
    [Note: free batch] then find)."""
    if batch_dims is None:
        return None
    names = [p.name for p in inspect.signature(model.forward).parameters.values()]
    spec: dict[str, Any] = {}
    for key, value in tops(args, kwargs):
        name = names[key] if isinstance(key, int) else str(key)
        leaves = [(_dynamic_dim(leaf, batch_dims.get(k, 0))) for k, leaf in leaves_of(key, value)]
        spec[name] = pytree.tree_unflatten(leaves, pytree.tree_flatten(value)[1])
    return spec


def _dynamic_dim(value: Any, dim: int) -> dict[int, Any] | None:
    """export's dynamic_shapes entry of one input leaf: its batch dim left to export."""
    return {dim: torch.export.Dim.AUTO} if isinstance(value, torch.Tensor) and value.dim() > dim else None


def _trace_export(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                  batch_dims: dict[InputKey, int] | None = None) -> Traced:
    # export logs and prints its own failures (graph dumps, tracebacks); the TraceError
    # we raise says what matters, so its output is silenced while it runs.
    logging.disable(logging.CRITICAL)
    called: list[str] = []
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            with recorded_functions(called):
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
    return Traced(gm, "export", keys, spec, leaves, tuple(regions))


def copy_traced(traced: Traced) -> Traced:
    """A copy of `traced` with its own graph (the model's tensors shared), to specialise
    without touching the original.  An fx graph reads sizes when it runs (`x.size(0)` is
    a node), so one fx trace serves every microbatch shape."""
    graph = torch.fx.Graph()
    mapping: dict[torch.fx.Node, torch.fx.Node] = {}
    out = next(n for n in traced.gm.graph.nodes if n.op == "output")
    graph.output(graph.graph_copy(traced.gm.graph, mapping), type_expr=out.type)
    gm = torch.fx.GraphModule(traced.gm, graph)
    leaves = [mapping.get(leaf, leaf) if isinstance(leaf, torch.fx.Node) else leaf for leaf in traced.output_leaves]
    return Traced(gm, traced.tracer, list(traced.input_keys), traced.out_spec, leaves, traced.autocast,
                  dict(traced.kept), traced.checkpointed)


def by_input_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[InputKey, Any]:
    """The example batch keyed as `Traced.input_keys` names it: position, keyword, or a
    path into a nested one ([Note: input leaves] in inputs.py)."""
    return flat_inputs(args, kwargs)


# -- checks and messages -----------------------------------------------------------------


def _check_runs(traced: Traced, model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Traced:
    """The graph must run on the example inputs (it is run again, timed, later); returns
    `traced` with every output leaf one tensor (`inputs.expand_outputs`)."""
    by_key = by_input_key(args, kwargs)
    flat = [by_key[key] for _name, key in traced.input_keys]
    with torch.no_grad():
        traced.gm.graph.lint()
        run = torch.fx.Interpreter(traced.gm, garbage_collect_values=False)
        _ = run.run(*flat)
    return expand_outputs(traced, run.env)


def _failure_message(failures: list[tuple[str, BaseException]], model_path: str) -> str:
    parts = []
    line = ""
    for name, exc in failures:
        where = user_frame(exc, model_path) if model_path else ""
        line = line or where
        first = str(exc).strip().splitlines()[0].rstrip(".") if str(exc).strip() else ""
        parts.append(f"{name}: {type(exc).__name__}: {first[:300]}")
    data_dependent = any(
        "control flow" in str(e) or "data-dependent" in str(e).lower() or "GuardOnDataDependent" in type(e).__name__
        for _, e in failures
    )
    library = _library_frame(failures[0][1], model_path) if len(failures) == 1 and failures[0][0] == "fx" else ""
    advice = (
        f"fx stopped inside library code{library}, a Python check torch.fx cannot "
        f"evaluate (BatchNorm testing `input.dim()`, say), not a branch in the model: use --tracer export "
        f"(or auto, which falls back to it)."
        if library
        else "The model's Python control flow depends on tensor values; rewrite the branch with "
        "tensor ops (torch.where, masking) or move it out of forward()."
        if data_dependent
        else "Make forward() traceable (no Python branching on tensor values, no unsupported "
        "calls), or force the other tracer with --tracer."
    )
    return (
        f"could not trace the model{line or ''}. Tried {'; '.join(parts)}. {advice}"
    )


def _library_frame(exc: BaseException, model_path: str) -> str:
    """' (<file>, line N: `<source>`)' when the deepest frame of an fx failure, below fx's own
    frames, lies outside the model file (PyTorch's BatchNorm checking `input.dim()`), else ''."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if "torch/fx/" not in f.filename.replace("\\", "/")]
    if not frames or (model_path and Path(frames[-1].filename).resolve() == Path(model_path).resolve()):
        return ""
    last = frames[-1]
    if "site-packages" not in last.filename and "/torch/" not in last.filename:
        return ""
    name = last.filename.replace("\\", "/")  # no folder of this machine ([Note: the model file's copy])
    short = name.split("site-packages/")[-1] if "site-packages/" in name else "torch/" + name.split("/torch/")[-1]
    return f" ({short}, line {last.lineno}: `{(last.line or '').strip()}`)"
