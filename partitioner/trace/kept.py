"""Submodules kept whole: what neither tracer can trace inside a larger model.

When fx and export both fail, the failure's deepest submodule (a data-dependent `if` in
its forward, say) is made an fx leaf and fx tries again, until the trace succeeds or the
failure is in the top-level module itself (then the compile is refused as before).

Each leaf call becomes one `call_function` node whose target is a `KeptModule` and whose
first argument is the module's state, `{name: get_attr(...)}` over every parameter and
buffer of it: the parameters stay ordinary get_attr reads of their original names (loaded,
saved, counted and placed like any other), and the node is costed as one node and placed
whole.  The generated stage holds the user's own module (`runtime.package.kept_module`)
and calls it on the stage's tensors: `torch.func.functional_call(self.block_module,
{"fc.weight": self.block_fc_weight, ...}, (x,))`.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import linecache
import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.fx
import torch.utils._pytree as pytree

__all__ = ["KeptModule", "failing_submodule", "module_line", "rewrite_kept", "rewrite_kept_export", "stubbed_for_export"]


@dataclass(frozen=True, eq=False)
class KeptModule:
    """A call of the user's module `path`, kept whole (`reason`: the line that broke tracing)."""

    module: torch.nn.Module
    path: str
    reason: str

    @property
    def __name__(self) -> str:  # fx and the cost passes name call targets
        return f"kept_{self.path.replace('.', '_')}"

    def __call__(self, state: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        return torch.func.functional_call(self._twin, dict(state), args, kwargs)

    @functools.cached_property
    def _twin(self) -> torch.nn.Module:
        """A copy of the module that the compiler's calls run, so that what its forward
        sets on itself (a dynamic rotary embedding's cached length) stays off the user's."""
        return _copy_sharing_tensors(self.module)


def _copy_sharing_tensors(module: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of `module` that holds its very parameters and buffers: its Python state
    is its own, its tensors are not copied."""
    memo: dict[int, Any] = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    return copy.deepcopy(module, memo)


def failing_submodule(exc: BaseException, model: torch.nn.Module) -> str | None:
    """The dotted path of the deepest module whose code raised `exc` ("" for the root), or
    None when no module's frame is on the traceback."""
    names = {id(m): path for path, m in model.named_modules()}
    found: str | None = None
    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and id(owner) in names:
            found = names[id(owner)]
        tb = tb.tb_next
    if found is None and exc.__cause__ is not None and exc.__cause__ is not exc:
        return failing_submodule(exc.__cause__, model)
    return found


def module_line(exc: BaseException, module: torch.nn.Module) -> str:
    """'<file>, line N: `<source>`' for the deepest frame of `exc` run by `module` (its
    file named from its package, `transformers/modeling_rope_utils.py`), '' if none."""
    found = ""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_locals.get("self") is module:
            name = tb.tb_frame.f_code.co_filename.replace("\\", "/")
            short = name.split("site-packages/")[-1] if "site-packages/" in name else Path(name).name
            found = f"{short}, line {tb.tb_lineno}: `{linecache.getline(name, tb.tb_lineno).strip()}`"
        tb = tb.tb_next
    if not found and exc.__cause__ is not None and exc.__cause__ is not exc:
        return module_line(exc.__cause__, module)
    return found


def rewrite_kept(gm: torch.fx.GraphModule, reasons: dict[str, str]) -> None:
    """Each `call_module` of a kept module -> a `KeptModule` call on its state's get_attrs."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_module":
            continue
        path = str(node.target)
        module = gm.get_submodule(path)
        with graph.inserting_before(node):
            state = {name: graph.get_attr(f"{path}.{name}")
                     for name, _ in [*module.named_parameters(remove_duplicate=False),
                                     *module.named_buffers(remove_duplicate=False)]}
            call = graph.call_function(KeptModule(module, path, reasons.get(path, "")), (state, *node.args),
                                       dict(node.kwargs))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        graph.erase_node(node)
    graph.lint()
    gm.recompile()


# [Note: kept whole under export]
# torch.export has no leaf modules: a module kept whole there is replaced, while export
# runs, by a stub that calls one opaque op, `partitioner::kept_call(tensors, call)`, on
# its input tensors; what export cannot trace (Hugging Face's dynamic RoPE branches on
# `torch.max(position_ids)`) is never entered.  The op's outputs have the shapes the
# module's real outputs had on the example batch: the model is run once beforehand with
# a copy of each kept module in its place (`_recorded_outputs`), so neither the model's
# buffers nor the kept module's own state change.  After export each op call, with the
# getitems that read its outputs, becomes a `KeptModule` call like fx's
# (`rewrite_kept_export`), so the stages run the user's module as they do under fx.


@dataclass
class _ExportCall:
    """One call of a kept module's stub while export ran: how to rebuild its arguments from
    the op's tensors (`leaves`: None where a tensor goes) and its output from its tensors."""

    path: str
    in_spec: pytree.TreeSpec
    leaves: list[Any]
    out_spec: pytree.TreeSpec
    out_leaves: list[Any]  # a real tensor of the recorded output per tensor leaf, else the value


#: the calls of the export now running, by the `call` number its op nodes carry
_CALLS: dict[int, _ExportCall] = {}


@torch.library.custom_op("partitioner::kept_call", mutates_args=())
def _kept_call(tensors: list[torch.Tensor], call: int) -> list[torch.Tensor]:
    """Never run: each node of this op is replaced by a `KeptModule` call after export."""
    raise RuntimeError("partitioner::kept_call only stands for a module kept whole while torch.export traces")


@_kept_call.register_fake
def _kept_call_fake(tensors: list[torch.Tensor], call: int) -> list[torch.Tensor]:
    """Tensors shaped as the module's outputs were on the example batch."""
    return [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
            for t in _CALLS[call].out_leaves if isinstance(t, torch.Tensor)]


def _recorded_outputs(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                      paths: list[str]) -> dict[str, list[Any]]:
    """path -> the outputs of each call of that kept module, in order, when `model` runs on
    the example batch; copies of the kept modules run in their place and the model's
    buffers are cloned, so nothing of the model changes."""
    outputs: dict[str, list[Any]] = {path: [] for path in paths}
    originals = {path: model.get_submodule(path) for path in paths}
    try:
        for path, module in originals.items():
            twin = _copy_sharing_tensors(module)
            twin.register_forward_hook(lambda _m, _a, out, path=path: outputs[path].append(out))
            _set_submodule(model, path, twin)
        buffers = {name: b.clone() for name, b in model.named_buffers(remove_duplicate=False)}
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.func.functional_call(model, buffers, args, kwargs, tie_weights=False)
    finally:
        for path, module in originals.items():
            _set_submodule(model, path, module)
    return outputs


def _set_submodule(model: torch.nn.Module, path: str, module: torch.nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent), name, module)


@contextlib.contextmanager
def stubbed_for_export(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                       paths: list[str]) -> Iterator[dict[int, _ExportCall]]:
    """Each kept module's forward replaced by its stub while the block runs ([Note: kept
    whole under export]); yields the calls the stubs made (none, the model untouched, when
    `paths` is empty)."""
    if not paths:
        yield {}
        return
    recorded = _recorded_outputs(model, args, kwargs, paths)
    _CALLS.clear()
    counts = dict.fromkeys(paths, 0)
    saved = {path: model.get_submodule(path).__dict__.get("forward") for path in paths}

    def stub(path: str, *call_args: Any, **call_kwargs: Any) -> Any:
        out_leaves, out_spec = pytree.tree_flatten(recorded[path][counts[path]])
        counts[path] += 1
        flat, in_spec = pytree.tree_flatten((call_args, call_kwargs))
        flat = [_concrete(v) for v in flat]
        call = len(_CALLS)
        _CALLS[call] = _ExportCall(path, in_spec, [None if isinstance(v, torch.Tensor) else v for v in flat],
                                   out_spec, out_leaves)
        tensors = iter(torch.ops.partitioner.kept_call([v for v in flat if isinstance(v, torch.Tensor)], call))
        return pytree.tree_unflatten([next(tensors) if isinstance(v, torch.Tensor) else v for v in out_leaves], out_spec)

    try:
        for path in paths:
            model.get_submodule(path).forward = functools.partial(stub, path)
        yield _CALLS
    finally:
        for path, forward in saved.items():
            module = model.get_submodule(path)
            if forward is None:
                del module.forward
            else:
                module.forward = forward


def _concrete(value: Any) -> Any:
    """A size given to a module kept whole as its example value: the batch it follows is
    then fixed, as export fixes any it cannot keep free ([Note: free batch])."""
    if isinstance(value, torch.SymInt):
        return int(value)
    if isinstance(value, torch.SymFloat):
        return float(value)
    return bool(value) if isinstance(value, torch.SymBool) else value


def rewrite_kept_export(gm: torch.fx.GraphModule, model: torch.nn.Module, calls: dict[int, _ExportCall],
                        reasons: dict[str, str]) -> None:
    """Each `partitioner::kept_call` node of an exported graph -> a `KeptModule` call on the
    module's state and its arguments; each getitem of the op's tensors -> the same leaf of
    the module's output ([Note: kept whole under export])."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.partitioner.kept_call.default:
            continue
        tensors, number = node.args
        assert isinstance(tensors, (list, tuple)) and isinstance(number, int)
        call = calls[number]
        module = model.get_submodule(call.path)
        given = iter(tensors)
        call_args, call_kwargs = pytree.tree_unflatten([next(given) if v is None else v for v in call.leaves], call.in_spec)
        with graph.inserting_before(node):
            state = {name: graph.get_attr(f"{call.path}.{name}")
                     for name, _ in [*module.named_parameters(remove_duplicate=False),
                                     *module.named_buffers(remove_duplicate=False)]}
            kept = graph.create_node("call_function", KeptModule(module, call.path, reasons.get(call.path, "")),
                                     (state, *call_args), dict(call_kwargs))
        kept.meta = {k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta")}
        paths = [p for p, v in pytree.tree_flatten_with_path(pytree.tree_unflatten(call.out_leaves, call.out_spec))[0]
                 if isinstance(v, torch.Tensor)]
        caller = dict(list(kept.meta.get("nn_module_stack", {}).items())[:-1])  # its output is read there
        for user in list(node.users):
            assert user.target is operator.getitem and isinstance(user.args[1], int)
            user.meta["nn_module_stack"] = caller
            user.replace_all_uses_with(_read(graph, kept, paths[user.args[1]], user))
            graph.erase_node(user)
        graph.erase_node(node)
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()


def _read(graph: torch.fx.Graph, value: torch.fx.Node, path: tuple[Any, ...], at: torch.fx.Node) -> torch.fx.Node:
    """The nodes that read the leaf at `path` (pytree keys) of `value`'s output, before `at`
    and with its meta: `out[i]`, `out[key]`, `out.name`."""
    for depth, key in enumerate(path, 1):
        with graph.inserting_before(at):
            if isinstance(key, pytree.GetAttrKey):
                read = graph.call_function(getattr, (value, key.name))
            else:
                read = graph.call_function(operator.getitem, (value, key.idx if isinstance(key, pytree.SequenceKey) else key.key))
        read.meta = {k: v for k, v in at.meta.items() if depth == len(path) or k not in ("val", "tensor_meta")}
        value = read
    return value
