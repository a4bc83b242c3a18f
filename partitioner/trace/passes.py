"""Graph passes over plain fx GraphModules: shape propagation and specialisation.

Like fx's own passes, each takes a GraphModule and writes `node.meta`:

- `propagate` runs the graph on one microbatch and records every node's real value
  (returned) and `node.meta["tensor_meta"]` (fx's `TensorMetadata`).
- `specialize` folds every non-tensor value (sizes, Python numbers) into a constant for that
  microbatch shape and drops assertions, so only tensors are left to cross stage
  boundaries.  The package is then fixed to the microbatch shape, which the manifest records,
  but for sizes that follow the batch: with the runs of `probe`, those fold into
  `batch.BatchInt`s that codegen writes as expressions of the batch ([Note: free batch]).
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.passes.shape_prop import TensorMetadata, _extract_tensor_metadata

from ..cost.nodes import is_shape_only, storage_key, tensors
from ..errors import TraceError
from .batch import PROBE_EXTRA, FreeBatch, NotFree, batch_constant, batch_dim, probe_batch
from .grad_mode import mark_grad_mode
from .inputs import InputKey

__all__ = ["Repeating", "Seen", "get_attr", "inline_higher_order", "probe", "propagate", "seen_run", "specialize",
           "is_tensor_node", "node_module"]

_ASSERTS = {
    "_assert_tensor_metadata",
    "_assert_scalar",
    "sym_constrain_range_for_size",
    "_assert",
    "_assert_async",
}


def propagate(gm: torch.fx.GraphModule, flat_inputs: list[Any], model_path: str = "") -> dict[torch.fx.Node, Any]:
    """Run `gm` on `flat_inputs` with autograd on; return each node's value (on shape-only
    tensors, a repeated op's result is a copy of its first: [Note: repeated ops on the meta
    device])."""
    values: dict[torch.fx.Node, Any] = {}

    class _Recorder(Repeating):
        def run_node(self, n: torch.fx.Node) -> Any:
            versions = _versions(n, values)
            try:
                result = super().run_node(n)
            except Exception as exc:
                where = n.meta.get("stack_trace", "") or ""
                raise TraceError(
                    f"running the traced graph failed at node {n.format_node()} "
                    f"({type(exc).__name__}: {exc}). Model source: {_last_user_line(where, model_path)}"
                ) from exc
            values[n] = result
            _record_writes(n, values, versions)
            _record_aliases(n, values)
            if isinstance(result, torch.Tensor):
                n.meta["tensor_meta"] = _extract_tensor_metadata(result)
            return result

    with torch.enable_grad():
        _Recorder(gm).run(*flat_inputs)
    return values


class Repeating(torch.fx.Interpreter):
    """fx's Interpreter, a repeated op on shape-only tensors served a copy of its first
    result ([Note: repeated ops on the meta device])."""

    def __init__(self, gm: torch.fx.GraphModule, **kwargs: Any) -> None:
        super().__init__(gm, **kwargs)
        self.repeats = _Repeats()

    def call_function(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self.repeats.call(super().call_function, target, args, kwargs)

    def call_method(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self.repeats.call(super().call_method, target, args, kwargs)


class _Repeats:
    """[Note: repeated ops on the meta device]
    A model too large to build runs on shape-only tensors (meta ones, or the fake CPU
    tensors of [Note: mixed precision on the meta device]), where an op only works out its
    result's shape and dtype, yet does so in Python (`_refs` decompositions: a layer_norm
    takes a millisecond, a clone two microseconds on meta), and such a model repeats one
    block a hundred times.  So within one run, a torch op whose every tensor holds only a
    shape, and whose result is new (a tensor or a list of them, sharing no storage with
    its inputs or each other, none of its inputs written), runs once per signature: the
    type and value of each argument, each tensor's type, device, shape, strides, dtype
    and requires_grad, and the grad and autocast modes.  A repeat gets a clone of the
    first result: the same shape, strides, dtype and requires_grad, on storage of its own,
    as the op's own result would be.  Views, in-place ops, what is not torch's own (a
    function the model wraps) and anything with data always run.  On Megatron-LM's
    529.6B model (105 blocks, 4951 nodes) a run took 0.3-0.5 s instead of 1.2-1.4 s."""

    def __init__(self) -> None:
        self.first: dict[Any, Any] = {}

    def call(self, run: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any], target: Any, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
        key = _signature(target, args, kwargs)
        if key is None:
            return run(target, args, kwargs)
        first = self.first.get(key)
        if first is not None:
            return _clone(first)
        inputs = tensors((args, kwargs))
        versions = [t._version for t in inputs]
        result = run(target, args, kwargs)
        if _new(result, inputs) and versions == [t._version for t in inputs]:
            copy = _clone(result)  # its own: the model may write the result
            if all(c.stride() == t.stride() for c, t in zip(_tensors_of(copy), _tensors_of(result))):
                self.first[key] = copy
        return result


def _clone(result: Any) -> Any:
    return type(result)(t.clone() for t in result) if isinstance(result, (tuple, list)) else result.clone()


def _tensors_of(result: Any) -> list[Any]:
    """A result's tensors, were it a tensor or a tuple or list of them (anything else: none)."""
    return [result] if isinstance(result, torch.Tensor) else list(result) if type(result) in (tuple, list) else []


def _signature(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What decides a torch op's result on shape-only tensors ([Note: repeated ops on the
    meta device]); None where the op is not torch's own or an argument is neither a
    shape-only tensor (meta or fake) nor a plain value."""
    if not (isinstance(target, str) or getattr(target, "__objclass__", None) is torch._C.TensorBase
            or (getattr(target, "__module__", None) or "").startswith(("torch", "_operator"))):
        return None
    try:
        key = (target, torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
               _plain(args), _plain(kwargs))
        hash(key)
    except (_Unplain, TypeError):  # TypeError: a symbolic size
        return None
    return key


class _Unplain(Exception):
    pass


_SHAPE_ONLY = (torch.Tensor, torch.nn.Parameter, FakeTensor)
_PLAIN = (bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format, type(None),
          type(Ellipsis))


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if type(value) not in _SHAPE_ONLY or not is_shape_only(value):
            raise _Unplain
        return (type(value), value.device, value.shape, value.stride(), value.dtype, value.layout,
                value.requires_grad)
    if isinstance(value, (tuple, list)):  # fx's immutable_list and torch.Size too
        return type(value), tuple(_plain(v) for v in value)
    if isinstance(value, dict):
        return dict, tuple((k, _plain(v)) for k, v in value.items())
    if type(value) is slice:
        return slice, _plain(value.start), _plain(value.stop), _plain(value.step)
    if type(value) in _PLAIN:
        return type(value), value
    raise _Unplain


def _new(result: Any, inputs: list[torch.Tensor]) -> bool:
    """Whether `result` is new shape-only tensors ([Note: repeated ops on the meta device]; a
    clone must also keep their strides)."""
    made = _tensors_of(result)
    if not made or any(type(t) not in _SHAPE_ONLY or not is_shape_only(t) for t in made):
        return False
    if any(type(d) is not int for t in made for d in t.shape):  # a size an op makes up (unbacked) each run
        return False
    storages = {storage_key(t) for t in made}
    return (len(storages) == len(made) and not storages & {storage_key(t) for t in inputs}
            and not any(t.requires_grad and t.is_leaf for t in made))


def probe(gm: torch.fx.GraphModule, keyed: dict[InputKey, Any], input_keys: list[tuple[str, InputKey]],
          batch_dims: dict[InputKey, int], rows: int, seen: dict[int, Seen | None] | None = None
          ) -> FreeBatch | None:
    """Run `gm` on the probe microbatches of [Note: free batch] (call it BEFORE the real
    `propagate`, whose tensor_meta must be the compiled microbatch's); None when a probe
    run fails, which keeps the batch fixed.  `seen`: earlier runs of copies of the same
    graph at other rows (`seen_run`; None: one that failed), which serve as probes in
    place of runs of their own (a search's microbatch shapes probe each other); the probe
    runs made join it."""
    if any(_recurrent(n) for n in gm.graph.nodes) or None in (seen or {}).values():
        return None  # see _RECURRENT; a row count some run could not take is not free
    free = FreeBatch([], [], [])
    nodes = {n.name: n for n in gm.graph.nodes}
    for other in sorted(r for r in seen or {} if r != rows)[:len(PROBE_EXTRA)]:
        values, shapes = seen[other]  # type: ignore[index,misc]
        free.rows.append(other)
        free.values.append({nodes[k]: v for k, v in values.items() if k in nodes})
        free.shapes.append({nodes[k]: v for k, v in shapes.items() if k in nodes})
    for extra in [e for e in PROBE_EXTRA if rows + e not in free.rows][:len(PROBE_EXTRA) - len(free.rows)]:
        batch = probe_batch(keyed, batch_dims, rows + extra)
        try:
            with torch.no_grad():
                values = propagate(gm, [batch[key] for _name, key in input_keys])
        except TraceError:
            if seen is not None:
                seen[rows + extra] = None
            return None
        shapes = _tensor_shapes(values)
        free.rows.append(rows + extra)
        free.values.append(values)
        free.shapes.append(shapes)
        if seen is not None:
            seen[rows + extra] = _by_name(values, shapes)
    return free


#: one run of a graph, by node name: the values with no tensor inside, and the tensors' shapes
Seen = tuple[dict[str, Any], dict[str, tuple[int, ...]]]


def seen_run(values: dict[torch.fx.Node, Any]) -> Seen:
    """What `probe` reads of a run (`propagate`'s values) by node name, to serve another
    copy of the graph as a probe."""
    return _by_name(values, _tensor_shapes(values))


def _by_name(values: dict[torch.fx.Node, Any], shapes: dict[torch.fx.Node, tuple[int, ...]]) -> Seen:
    return {n.name: v for n, v in values.items() if _foldable(v)}, {n.name: s for n, s in shapes.items()}


def _tensor_shapes(values: dict[torch.fx.Node, Any]) -> dict[torch.fx.Node, tuple[int, ...]]:
    """Each tensor node's shape in a run (`propagate`'s values)."""
    return {n: tuple(int(d) for d in v.shape) for n, v in values.items() if isinstance(v, torch.Tensor)}


#: recurrent ops keep a fixed batch: their initial state is traced at the compiled batch, and
#: the CPU kernels abort the process (not an exception `probe` could catch) on another one
_RECURRENT = {"lstm", "gru", "rnn_tanh", "rnn_relu"}


def _recurrent(node: torch.fx.Node) -> bool:
    name = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
    return name.split(".")[0] in _RECURRENT


def specialize(gm: torch.fx.GraphModule, values: dict[torch.fx.Node, Any], free: FreeBatch | None = None,
               rows: int = 0) -> bool:
    """Fold non-tensor nodes into constants and remove assertions and dead code.

    With the probe runs `free` (`probe`) of a microbatch of `rows` rows, sizes that follow
    the batch fold into `BatchInt`s and tensors get `meta["batch_dim"]` ([Note: free
    batch]); returns whether the batch is free (False: folded for `rows` only)."""
    folded: dict[torch.fx.Node, Any] | None = None
    if free is not None:
        every = FreeBatch([rows, *free.rows], [values, *free.values], [_tensor_shapes(values), *free.shapes])
        try:
            folded = _fold_free(gm, values, every)
        except NotFree:
            folded = None
    _fold(gm, values, folded)
    return folded is not None


def _fold_free(gm: torch.fx.GraphModule, values: dict[torch.fx.Node, Any], free: FreeBatch) -> dict[torch.fx.Node, Any]:
    """The constant of each foldable node, BatchInts included, and each tensor's batch dim."""
    folded: dict[torch.fx.Node, Any] = {}
    dims: dict[torch.fx.Node, tuple[int, int] | None] = {}
    for node in gm.graph.nodes:
        value = values.get(node)
        if isinstance(value, torch.Tensor):
            dims[node] = batch_dim(node, free)
        elif node.op not in ("placeholder", "output", "get_attr") and not _is_assert(node) and _foldable(value):
            folded[node] = batch_constant(node, _constant(value), free)
    for node, dim in dims.items():
        node.meta["batch_dim"] = dim
    return folded


def _fold(gm: torch.fx.GraphModule, values: dict[torch.fx.Node, Any], folded: dict[torch.fx.Node, Any] | None) -> None:
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        if _is_assert(node):
            if not node.users:
                graph.erase_node(node)
            continue
        value = values.get(node)
        if _foldable(value):
            constant = folded[node] if folded is not None and node in folded else _constant(value)
            node.replace_all_uses_with(constant, propagate_meta=False)  # type: ignore[arg-type]
            graph.erase_node(node)
        elif _whole_slice(node):  # export's `x[:]` on a dynamic dimension: x itself
            node.replace_all_uses_with(node.args[0])  # type: ignore[arg-type]
            graph.erase_node(node)
    graph.eliminate_dead_code(is_impure_node=_writes_or_impure)
    graph.lint()
    gm.recompile()


def _writes_or_impure(node: torch.fx.Node) -> bool:
    """Kept without users: a node that writes an input in place (fx's `x.add_(1)` on a
    buffer is a call_method fx would drop), or one fx calls impure."""
    return "writes" in node.meta or node.is_impure()


def inline_higher_order(gm: torch.fx.GraphModule) -> list[bool]:
    """Inline torch.export's grad-mode and autocast wrappers into the graph.

    `wrap_with_set_grad_enabled(False, submod, *args)` (e.g. Llama's rotary embedding under
    `torch.no_grad()`) becomes the submodule's nodes, marked for `grad_mode.keep_no_grad` to
    detach what they read ([Note: no_grad regions]), followed by `aten.detach` on each
    output, which stops gradients exactly as no_grad did.  Autocast regions are inlined
    as they are and reported, for `trace.check_autocast` to refuse where that changes what
    the model computes (a disabled region in a float32 model is a no-op).
    Export's `_guards_fn` module, which only re-checks input shapes, is dropped.
    Returns the `enabled` flag of each autocast region inlined (`trace.check_autocast`).
    """
    graph = gm.graph
    regions: list[bool] = []
    for node in list(graph.nodes):
        if node.op == "call_module" and str(node.target) == "_guards_fn" and not node.users:
            graph.erase_node(node)
            continue
        name = getattr(node.target, "__name__", "")
        if node.op != "call_function" or name not in ("wrap_with_set_grad_enabled", "wrap_with_autocast"):
            continue
        if name == "wrap_with_set_grad_enabled":  # (enabled, submod, *args)
            enabled, sub_node, operands = node.args[0], node.args[1], list(node.args[2:])
        else:  # wrap_with_autocast(device, dtype, enabled, cache_enabled, submod, *args)
            regions.append(bool(node.args[2]))
            enabled, sub_node, operands = True, node.args[4], list(node.args[5:])
        sub = getattr(gm, str(sub_node.target))  # type: ignore[union-attr]
        outputs = _inline(graph, node, sub, operands, detach=not enabled)
        for user in list(node.users):
            assert user.target is operator.getitem, user.format_node()
            user.replace_all_uses_with(outputs[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(node)
    graph.eliminate_dead_code()
    graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()
    return regions


def _inline(graph: torch.fx.Graph, at: torch.fx.Node, sub: torch.fx.GraphModule, operands: list[Any],
            detach: bool) -> list[torch.fx.Node]:
    env: dict[torch.fx.Node, Any] = {}
    inputs = iter(operands)
    outputs: list[torch.fx.Node] = []
    with graph.inserting_before(at):
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                env[n] = next(inputs)
            elif n.op == "output":
                for value in n.args[0]:
                    v = env[value]
                    outputs.append(graph.call_function(torch.ops.aten.detach.default, (v,)) if detach else v)
            elif n.op == "get_attr":
                raise TraceError(f"cannot inline {at.format_node()}: its body reads attribute {n.target}")
            else:
                env[n] = graph.node_copy(n, lambda a: env[a])
                mark_grad_mode(env[n], enabled=not detach)  # [Note: no_grad regions]
    return outputs


def get_attr(gm: torch.fx.GraphModule, target: str) -> Any:
    """The value a get_attr node reads: `h.0.attn.c_attn.weight` walked from `gm`."""
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def is_tensor_node(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("tensor_meta"), TensorMetadata)


def node_module(node: torch.fx.Node) -> str:
    """Dotted path of the innermost nn.Module that created `node` ("" at top level)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return str(path).replace("L['self'].", "").replace("L__self___", "")


# -- helpers -----------------------------------------------------------------------------


def _versions(node: torch.fx.Node, values: dict[torch.fx.Node, Any]) -> dict[torch.fx.Node, int]:
    """The version counter of every tensor `node` reads, before it runs."""
    return {x: values[x]._version for x in node.all_input_nodes if isinstance(values.get(x), torch.Tensor)}


def _record_writes(node: torch.fx.Node, values: dict[torch.fx.Node, Any], before: dict[torch.fx.Node, int]) -> None:
    """`node.meta["writes"]`: the names of the inputs `node` wrote in place (their version
    counters moved: `relu_`, `x += y`, BatchNorm's running statistics and counter).
    [Note: in-place ops] The profiler clones what a node writes before each timed call
    (cost/profile.py), and a stage clones an input it writes, since a stage input is an
    autograd leaf (codegen/package.py)."""
    written = tuple(x.name for x, v in before.items() if values[x]._version != v)
    if written:
        node.meta["writes"] = written


def _record_aliases(node: torch.fx.Node, values: dict[torch.fx.Node, Any]) -> None:
    """`node.meta["aliases"]`: the inputs whose storage `node`'s result shares (a view,
    `x.view(...)`, `split`'s pieces, or an in-place op's result).  The solver reads it: a
    view computes nothing ([Note: every stage computes] in solve/solve.py), and a view of a
    buffer that is written reads that buffer ([Note: a mutated buffer lives on one stage]
    in trace/buffers.py)."""
    made = {storage_key(t) for t in tensors(values.get(node))}
    shared = tuple(x.name for x in node.all_input_nodes if made & {storage_key(t) for t in tensors(values.get(x))})
    if shared:
        node.meta["aliases"] = shared



def _is_assert(node: torch.fx.Node) -> bool:
    name = getattr(node.target, "__name__", "") or str(node.target)
    return any(a in name for a in _ASSERTS) and node.op == "call_function"


def _whole_slice(node: torch.fx.Node) -> bool:
    """`aten.slice.Tensor(x, dim, 0, 2**63 - 1)`: every row, step 1."""
    if node.target is not torch.ops.aten.slice.Tensor or node.kwargs:
        return False
    args = list(node.args) + [0, 0, None, 1][len(node.args) - 1:]
    return bool(args[2] in (0, None) and args[3] in (None, 2**63 - 1) and args[4] == 1)


def _foldable(value: Any) -> bool:
    """A value with no tensor inside it is specialised to a constant."""
    if isinstance(value, torch.Tensor):
        return False
    if isinstance(value, (tuple, list)):
        return all(_foldable(v) for v in value)
    return isinstance(value, (int, float, bool, type(None), str, torch.Size, torch.dtype, torch.device))


def _constant(value: Any) -> Any:
    if isinstance(value, torch.Size):
        return tuple(int(v) for v in value)
    if isinstance(value, list):
        return [_constant(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_constant(v) for v in value)
    return value


def _last_user_line(stack_trace: str, model_path: str) -> str:
    lines = [ln.strip() for ln in stack_trace.strip().splitlines() if ln.strip()]
    if model_path:
        for i in range(len(lines) - 1, -1, -1):
            if model_path.split("/")[-1] in lines[i] and lines[i].startswith("File"):
                return " ".join(lines[i : i + 2])
    return " ".join(lines[-2:]) if lines else "unknown"

