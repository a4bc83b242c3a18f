"""The fx tracer: `torch.fx` symbolic tracing that goes *through* every module (no leaf
modules but those kept whole), so parameters are `get_attr` nodes named by their original
fully-qualified names and all compute is `call_function` / `call_method`."""

from __future__ import annotations

import inspect
from typing import Any, Collection

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.fx._symbolic_trace import PH

from ..errors import TraceError
from .autocast import recording_autocast
from .functions import functions_as_leaves, short_name
from .grad_mode import mark_grad_mode
from .inputs import InputKey, fix_placeholder, flat_codegen, leaves_of, nested_placeholders
from .kept import rewrite_kept
from .outputs import output_tree
from .state import watching_state
from .traced import Traced, graph_module

__all__ = ["trace_fx"]


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
        #: the structure of what forward returned ([Note: output classes] in outputs.py)
        self.out_spec: pytree.TreeSpec | None = None
    #: a buffer read in forward is a get_attr of its name, never a constant of its value at
    #: trace time (`self.cval.clone()` would be frozen into the stage's code)
    proxy_buffer_attributes = True

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.leaves

    def create_args_for_root(self, root_fn: Any, is_module: bool, concrete_args: Any = None) -> tuple[Any, list[Any]]:
        """fx's root function, returning the leaves of what forward returns: its structure,
        its own class kept (a NamedTuple, a dataclass, a ModelOutput), is `self.out_spec`
        ([Note: output classes] in outputs.py)."""
        fn, args = super().create_args_for_root(root_fn, is_module, concrete_args)

        def flat(*inputs: Any) -> list[Any]:
            out = fn(*inputs)
            info = getattr(self.graph._codegen, "pytree_info", None)
            if info is not None:  # fx flattened it already (nested inputs): the object again
                out = pytree.tree_unflatten(out, info.out_spec)
            leaves, self.out_spec = output_tree(out)
            return leaves

        return flat, args

    def _proxy_placeholder(self, name: str, concrete_args: dict[str, Any] | None, sig: inspect.Signature,
                           fn_for_analysis: Any) -> Any:
        """fx's placeholder of a parameter; `**kwargs` given in `concrete_args` is the dict
        of the keywords it holds, a placeholder at each of their tensor leaves."""
        if name.startswith("**") and concrete_args is not None and name in concrete_args:
            return {key: self._keyword(key, value) for key, value in concrete_args[name].items()}
        return super()._proxy_placeholder(name, concrete_args, sig, fn_for_analysis)

    def _keyword(self, key: str, value: Any) -> Any:
        """A keyword of `**kwargs`: `value` with a placeholder for each PH in it."""
        if value is PH:
            return self.create_proxy("placeholder", key, (), {})
        leaves, spec = pytree.tree_flatten(value)
        return pytree.tree_unflatten([self.create_proxy("placeholder", f"{key}_{i}", (), {}) if leaf is PH else leaf
                                      for i, leaf in enumerate(leaves)], spec)

    def create_node(self, *args: Any, **kwargs: Any) -> torch.fx.Node:
        """fx's node, marked when made under `torch.no_grad()` ([Note: no_grad regions])."""
        node = super().create_node(*args, **kwargs)
        mark_grad_mode(node)
        return node

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


def trace_fx(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
              kept: dict[str, str] | None = None) -> Traced:
    """The fx trace of `model(*args, **kwargs)`, the submodules of `kept` (path -> why)
    kept whole as calls."""
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
    named = [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    extra = {k: v for k, v in kwargs.items() if k not in {p.name for p in named}}  # what **kwargs holds
    nested = nested_placeholders({k: v for k, v in given.items() if k not in extra})  # [Note: input leaves] in inputs.py
    concrete |= _keywords(params, extra)
    with recording_autocast() as regions:
        tracer, graph = _traced_keeping_buffers(model, concrete | nested, kept or {})
    flat_codegen(graph)
    for node in graph.nodes:  # a tensor default would be written as an unbound `_tensor_constant0`
        if node.op == "placeholder" and any(isinstance(a, (torch.Tensor, torch.fx.Node)) for a in node.args):
            node.args = ()
    gm = graph_module(model, graph)
    # fx makes a placeholder for every parameter of forward(), in signature order (one per
    # leaf of a nested one), then one per tensor leaf of the keywords `**kwargs` holds;
    # those fixed to their defaults are replaced by the default and their guards dropped,
    # and so are the non-tensor leaves of nested ones ([Note: input leaves] in inputs.py).
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
    for name, value in extra.items():
        keys += [(next(placeholders).name, key) for key, leaf in leaves_of(name, value) if isinstance(leaf, torch.Tensor)]
    gm.recompile()
    if kept:
        rewrite_kept(gm, kept)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    assert tracer.out_spec is not None
    return Traced(gm, "fx", keys, tracer.out_spec, list(out.args[0]), tuple(regions), dict(kept or {}))


def _keywords(params: list[inspect.Parameter], extra: dict[str, Any]) -> dict[str, Any]:
    """fx's `concrete_args` entry for forward's `**kwargs`: the keywords the example batch
    gives it, PH at each tensor leaf (`_ThroughTracer._proxy_placeholder`); an empty dict
    when it gives none, as a call without them passes."""
    var = next((p for p in params if p.kind is p.VAR_KEYWORD), None)
    if var is None:
        return {}
    return {f"**{var.name}": {k: pytree.tree_map(lambda v: PH if isinstance(v, torch.Tensor) else v, v)
                              for k, v in extra.items()}}


def _traced_keeping_buffers(model: torch.nn.Module, concrete: dict[str, Any],
                            kept: dict[str, str]) -> tuple[_ThroughTracer, torch.fx.Graph]:
    """The fx graph of `model` and the tracer that made it; a buffer the forward rebinds (`self.steps += 1` assigns the
    in-place result back, a Proxy while tracing) is put back as it was."""
    owners = [(path, m, name, b) for path, m in model.named_modules() for name, b in m._buffers.items()]
    tracer, inlined = _ThroughTracer(kept), list[str]()
    try:
        # the model's own torch.no_grad() regions are told apart from the trace's grad mode
        with functions_as_leaves(tracer, inlined), torch.enable_grad(), watching_state(model):
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
    return tracer, graph


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
