"""Write one stage's Python source: readable, one statement per line, shape comments.

The emitter walks the stage's fx nodes in order and prints each as the call a person
would write: `F.linear(x, self.fc1_weight, self.fc1_bias)`, `a + b`, `x[:, -1]`,
`x.transpose(1, 2)`, `aten.addmm.default(...)` for torch.export's aten ops, under a
`# -- h.0.attn --` line wherever the module they come from changes.  The names it writes
are given by `codegen.names`.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx
import torch.nn.functional as F
import torch.utils._pytree as pytree

from partitioner.trace.batch import BatchInt
from partitioner.trace.functions import function_of
from partitioner.trace.kept import KeptModule
from partitioner.trace.modes import ModeValue, draws_a_mask, with_mode
from runtime import outputs

from .names import attr_name, section, spec_class

__all__ = ["BATCH", "MODEL_FILE", "StageSource", "attr_name", "batch_dim", "format_value", "shape_comment", "uses_batch"]

#: the name a stage gives its microbatch's rows when sizes follow them ([Note: free batch])
BATCH = "batch"
#: in `StageSource.imports`: the stage reads classes of the model file (`model = model_file_of(__file__)`)
MODEL_FILE = "model file"

_BINARY = {
    operator.add: "+", operator.sub: "-", operator.mul: "*", operator.truediv: "/",
    operator.floordiv: "//", operator.mod: "%", operator.pow: "**", operator.matmul: "@",
    operator.and_: "&", operator.or_: "|", operator.xor: "^", operator.lshift: "<<",
    operator.rshift: ">>", operator.eq: "==", operator.ne: "!=", operator.lt: "<",
    operator.le: "<=", operator.gt: ">", operator.ge: ">=",
}
_UNARY = {operator.neg: "-", operator.pos: "+", operator.invert: "~"}


def _drops_a_shard(node: torch.fx.Node) -> bool:
    """Whether `node` is a dropout of a value sharded across the tensor-parallel group
    (its layout, `tp_layout`, as partitioner/tp/rewrite.py recorded it): it draws from
    its rank's own stream (`tp.rank_stream`, [Note: dropout streams] in runtime/modes.py)."""
    layout = node.meta.get("tp_layout")
    return (draws_a_mask(node) and layout is not None
            and layout.dim is not None and bool(node.all_input_nodes))


class EmitError(Exception):
    """A node the code generator cannot write as Python source."""


def format_value(value: Any, names: dict[torch.fx.Node, str], batch: str = BATCH, device: str | None = None) -> str:
    """A node argument as Python source: `batch` names the microbatch's rows ([Note: free
    batch]); a `torch.device` is written as `device` where one is given ([Note: devices in
    stage code])."""
    if isinstance(value, torch.fx.Node):
        return names[value]
    if isinstance(value, BatchInt):  # written as an expression of the rows, or fixed (batch "")
        return value.expr(batch) if batch else repr(int(value))
    if isinstance(value, (tuple, list, dict)):
        return _format_container(value, names, batch, device)
    if isinstance(value, float):
        if math.isinf(value):
            return "float('inf')" if value > 0 else "float('-inf')"
        return "float('nan')" if math.isnan(value) else repr(value)
    if isinstance(value, torch.device):
        return device or f"torch.device({str(value)!r})"
    if isinstance(value, (torch.dtype, torch.memory_format, torch.layout)):
        return str(value)
    if value is Ellipsis:
        return "..."
    if isinstance(value, ModeValue):  # [Note: modes in generated code] in partitioner/trace/modes.py
        return repr(value)
    if isinstance(value, slice):
        return (f"slice({format_value(value.start, names, batch)}, {format_value(value.stop, names, batch)}, "
                f"{format_value(value.step, names, batch)})")
    if isinstance(value, (int, bool, str, type(None))):
        return repr(value)
    raise EmitError(f"cannot write a constant of type {type(value).__name__}: {value!r}")


def _format_container(value: tuple[Any, ...] | list[Any] | dict[Any, Any], names: dict[torch.fx.Node, str],
                      batch: str, device: str | None) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {format_value(v, names, batch, device)}" for k, v in value.items()) + "}"
    items = [format_value(v, names, batch, device) for v in value]
    if isinstance(value, list):
        return f"[{', '.join(items)}]"
    return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"


def uses_batch(nodes: list[torch.fx.Node]) -> bool:
    """Whether any of `nodes` has an argument that follows the batch size (a BatchInt)."""
    found: list[bool] = []

    def visit(value: Any) -> Any:
        found.append(isinstance(value, BatchInt))
        return value

    for node in nodes:
        torch.fx.node.map_aggregate((node.args, node.kwargs), visit)
    return any(found)


def _format_index(index: Any, names: dict[torch.fx.Node, str], batch: str = BATCH) -> str:
    """The inside of `x[...]`, with slices written as `a:b`."""
    if isinstance(index, tuple):
        return ", ".join(_format_index(i, names, batch) for i in index) if index else "()"
    if isinstance(index, slice):
        parts = ["" if p is None else format_value(p, names, batch) for p in (index.start, index.stop)]
        text = ":".join(parts)
        return text + (f":{format_value(index.step, names, batch)}" if index.step is not None else "")
    return format_value(index, names, batch)


@dataclass
class StageSource:
    """Collects the imports a stage needs while its statements are written; `device` is the
    expression every device in the stage's code is written as ([Note: devices in stage code])."""

    imports: set[str]
    device: str | None = None
    batch: str = BATCH  # the name of the microbatch's rows in this stage ([Note: free batch])
    #: attribute -> the user's module kept whole it holds (partitioner.trace.kept)
    kept: dict[str, KeptModule] = field(default_factory=dict)
    #: the dataclasses the output is made of, as the stage names them, which it registers
    #: as pytree nodes ([Note: output classes] in partitioner/trace/outputs.py)
    outputs: list[str] = field(default_factory=list)

    def callee(self, target: Callable[..., Any]) -> str:
        """The shortest importable name for a call target."""
        if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            return self._operator(target)
        function = function_of(target)
        if function is not None:
            return f"{self.user_class(function)}.apply"
        name = getattr(target, "__name__", "")
        if getattr(target, "__module__", None) == "runtime.tp":  # the tensor-parallel collectives
            self.imports.add("from runtime import tp")
            return f"tp.{name}"
        if name and getattr(F, name, None) is target:
            self.imports.add("F")
            return f"F.{name}"
        if name and getattr(torch, name, None) is target:
            return f"torch.{name}"
        if getattr(target, "__module__", None) == "builtins":
            return name
        qualified = torch.fx.node._get_qualified_name(target)
        module = qualified.rsplit(".", 1)[0]
        if "<" in qualified or module.startswith("_partitioner_model"):
            raise EmitError(
                f"{qualified} is defined in the model file; the generated stages cannot import "
                f"it. Move it into an importable module."
            )
        self.imports.add(f"import {module}")
        return qualified

    def _kept_call(self, target: KeptModule, args: Any, kwargs: Any, fmt: Callable[[Any], str], state: str) -> str:
        """`torch.func.functional_call(self.<module>, {<its tensors>}, (<inputs>,))`: the user's
        module kept whole, run on the stage's parameters and buffers; `state` names the dict
        of them where the stage takes back the buffers the call rebinds ([Note: buffers a
        kept module rebinds]), else it is written inline."""
        attr = f"{attr_name(target.path)}_module"
        self.kept[attr] = target
        self.imports.add("from runtime.package import kept_module")
        inputs = fmt(tuple(args[1:]))
        extra = f", {fmt(dict(kwargs))}" if kwargs else ""
        return f"torch.func.functional_call(self.{attr}, {state or fmt(args[0])}, {inputs}{extra})"

    def user_class(self, cls: type) -> str:
        """How a stage names a class of the user's: `model.<Name>` when the model file defines
        it (`runtime.package.model_file_of`), else `<module>.<Name>` imported."""
        if cls.__module__.startswith("_partitioner_model") or "<" in cls.__qualname__:
            if "<" in cls.__qualname__:
                raise EmitError(f"{cls.__qualname__} is defined inside a function; the generated stages cannot "
                                f"import it. Define it at the top level of the model file.")
            self.imports.update({MODEL_FILE, "from runtime.package import model_file_of"})
            return f"model.{cls.__qualname__}"
        self.imports.add(f"import {cls.__module__}")
        return f"{cls.__module__}.{cls.__qualname__}"

    def _operator(self, target: torch._ops.OpOverload | torch._ops.OpOverloadPacket) -> str:
        """`aten.<name>` for an aten op; `torch.ops.<ns>.<name>` for a custom one (Hugging
        Face's `transformers::grouped_mm_fallback`), with an import of the module that
        registers it when torch.library knows it (`torch.library.custom_op`)."""
        namespace = getattr(target, "namespace", "aten")
        if namespace == "aten":
            self.imports.add("aten")
            return f"aten.{target.__name__}"
        packet = target.__name__.split(".")[0]
        definition = torch._library.custom_ops.OPDEFS.get(f"{namespace}::{packet}")
        module = getattr(getattr(definition, "_init_fn", None), "__module__", None)
        if module and not module.startswith("_partitioner_model"):
            self.imports.add(f"import {module}")
        return f"torch.ops.{namespace}.{target.__name__}"

    def statement(self, node: torch.fx.Node, names: dict[torch.fx.Node, str]) -> str:
        """`<name> = <expression>` for one call node."""
        args, kwargs = node.args, node.kwargs
        fmt = lambda v: format_value(v, names, self.batch, self.device)  # noqa: E731
        target = node.target
        if node.op == "call_function" and target in _BINARY and len(args) == 2 and not kwargs:
            expr = f"{fmt(args[0])} {_BINARY[target]} {fmt(args[1])}"  # type: ignore[index]
        elif node.op == "call_function" and target in _UNARY and len(args) == 1:
            expr = f"{_UNARY[target]}{fmt(args[0])}"  # type: ignore[index]
        elif node.op == "call_function" and target is operator.getitem:
            expr = f"{fmt(args[0])}[{_format_index(args[1], names, self.batch)}]"
        elif node.op == "call_function" and target is getattr:
            expr = f"{fmt(args[0])}.{args[1]}"
        elif node.op == "call_method":
            call = ", ".join([fmt(a) for a in args[1:]] + [f"{k}={fmt(v)}" for k, v in kwargs.items()])
            expr = f"{fmt(args[0])}.{target}({call})"
        elif node.op == "call_function" and isinstance(target, KeptModule):
            state = f"{names[node]}_state" if _held_buffers(node, names) else ""
            expr = self._kept_call(target, args, kwargs, fmt, state)
        elif node.op == "call_function":
            args, kwargs = with_mode(target, args, dict(kwargs))  # [Note: modes in generated code]
            kwargs = _without_defaults(target, kwargs)
            if self.device is not None and "device" not in kwargs and _is_factory(target):
                kwargs = {**kwargs, "device": torch.device("cpu")}  # written as self.device
            call = ", ".join([fmt(a) for a in args] + [f"{k}={fmt(v)}" for k, v in kwargs.items()])
            expr = f"{self.callee(target)}({call})"  # type: ignore[arg-type]
        else:
            raise EmitError(f"cannot write node {node.format_node()}: op {node.op!r} is not traced through")
        return f"{names[node]} = {expr}"

    def statements(self, nodes: list[torch.fx.Node], names: dict[torch.fx.Node, str]) -> list[str]:
        """One line per node, in order, with its shape comment; each run of nodes from one
        module opens with a `# -- <module> --` line (`names.section`); a dropout of a
        tensor-parallel shard is written inside `with tp.rank_stream(...)`."""
        lines: list[str] = []
        current = None
        for node in nodes:
            if section(node) != current:
                current = section(node)
                lines.append(f"# -- {current} --")
            line = f"{self.statement(node, names)}{shape_comment(node, self.batch)}"
            if _drops_a_shard(node):
                self.imports.add("from runtime import tp")
                lines.append(f"with tp.rank_stream({names[node.all_input_nodes[0]]}.device, self.training):")
                line = f"    {line}"
            lines += _with_kept_state(line, node, names)
        return lines

    def build_output(self, spec: pytree.TreeSpec, leaves: list[Any], names: dict[torch.fx.Node, str]) -> str:
        """Source that rebuilds the model's output structure from its leaves."""
        it = iter(leaves)
        return self._build(spec, it, names)

    def _build(self, spec: pytree.TreeSpec, leaves: Any, names: dict[torch.fx.Node, str]) -> str:
        if spec.is_leaf():
            return format_value(next(leaves), names, self.batch)
        children = [self._build(c, leaves, names) for c in spec.children()]
        kind = spec.type
        if kind is tuple:
            return f"({children[0]},)" if len(children) == 1 else f"({', '.join(children)})"
        if kind is list:
            return f"[{', '.join(children)}]"
        if kind is dict:
            return "{" + ", ".join(f"{k!r}: {v}" for k, v in zip(spec.context, children)) + "}"
        if kind is type(None):  # a NamedTuple's or a dataclass's field left None
            return "None"
        cls = spec_class(spec)
        assert cls is not None, f"an output node of type {kind} names no class"
        name = self.user_class(cls)  # [Note: output classes] in partitioner/trace/outputs.py
        if cls in outputs.REGISTERED:  # a dataclass pytree knows only once registered
            self.imports.add("from runtime.package import register_output")
            self.outputs.append(name)
        return f"{name}({_class_arguments(cls, spec.context, children)})"


# [Note: buffers a kept module rebinds]
# A module kept whole may rebind its own buffers in forward (a dynamic rotary embedding's
# `self.register_buffer("inv_freq", ...)` past its maximum length) beside Python state of
# its own (`self.max_seq_len_cached`).  The stage holds the module, whose Python state so
# lives from call to call as in the original, and the buffers; it calls the module on a
# dict of them, which `torch.func.functional_call` updates with what forward rebound, and
# takes them back:
#     rotary_state = {'inv_freq': self.rotary_inv_freq}
#     rotary = torch.func.functional_call(self.rotary_module, rotary_state, (x, position_ids))
#     self.rotary_inv_freq = rotary_state['inv_freq']
# so the next call (the next microbatch, the next step) reads what the original's reads.


def _held_buffers(node: torch.fx.Node, names: dict[torch.fx.Node, str]) -> dict[str, str]:
    """Buffer name -> the stage's attribute holding it, for a call of a module kept whole
    ([Note: buffers a kept module rebinds]); {} for any other node."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, KeptModule):
        return {}
    buffers = {name for name, _ in target.module.named_buffers(remove_duplicate=False)}
    state = node.args[0]
    assert isinstance(state, dict)
    return {name: names[value] for name, value in state.items()
            if name in buffers and isinstance(value, torch.fx.Node) and names[value].startswith("self.")}


def _with_kept_state(line: str, node: torch.fx.Node, names: dict[torch.fx.Node, str]) -> list[str]:
    """`line` alone, or, for a call of a module kept whole whose buffers the stage holds,
    between `<name>_state = {...}` and `self.<buffer> = <name>_state[<its name>]` for each
    ([Note: buffers a kept module rebinds])."""
    held = _held_buffers(node, names)
    if not held:
        return [line]
    local = f"{names[node]}_state"
    return [f"{local} = {format_value(node.args[0], names)}", line,
            *(f"{attr} = {local}[{name!r}]" for name, attr in held.items())]


def _class_arguments(cls: type, context: Any, children: list[str]) -> str:
    """The arguments that make an instance of `cls` from its children (source), as pytree's
    own unflatten does from `context`: positions for a NamedTuple, one tuple for a structseq
    (`torch.return_types.max`), keywords for a ModelOutput and a registered dataclass (its
    fields that were None given as None), a dict for another dict."""
    if pytree.is_namedtuple_class(cls):
        return ", ".join(children)
    if pytree.is_structseq_class(cls):
        return f"({children[0]},)" if len(children) == 1 else f"({', '.join(children)})"
    if _keys(context):
        if all(k.isidentifier() for k in context):
            return ", ".join(f"{k}={v}" for k, v in zip(context, children))
        if issubclass(cls, dict):
            return "{" + ", ".join(f"{k!r}: {v}" for k, v in zip(context, children)) + "}"
    if dataclasses.is_dataclass(cls) and isinstance(context, list) and len(context) == 2 and all(map(_keys, context)):
        given, none = context  # pytree.register_dataclass's context: the fields given, those None
        return ", ".join([f"{k}={v}" for k, v in zip(given, children)] + [f"{k}=None" for k in none])
    return ", ".join(children)


def _keys(context: Any) -> bool:
    """Whether a pytree context is a list of str (a dict's or a ModelOutput's keys)."""
    return isinstance(context, (list, tuple)) and all(isinstance(k, str) for k in context)


#: torch's factory functions: they make a tensor from sizes or data, on the CPU unless told
_FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.range, torch.rand, torch.randn,
              torch.randint, torch.randperm, torch.eye, torch.linspace, torch.logspace, torch.tensor,
              torch.scalar_tensor, torch.as_tensor}


def _is_factory(target: Any) -> bool:
    """Whether a call makes a tensor from no tensor, so that it needs a device: one of torch's
    factory functions, or an aten op with a `device` argument and no tensor argument."""
    if isinstance(target, torch._ops.OpOverload):
        arguments = target._schema.arguments
        return any(a.name == "device" for a in arguments) and not any("Tensor" in str(a.type) for a in arguments)
    try:
        return target in _FACTORIES
    except TypeError:  # an unhashable callable
        return False


def _without_defaults(target: Any, kwargs: Any) -> dict[str, Any]:
    """Keyword arguments that differ from the Python function's defaults (as a person
    writes `F.embedding(idx, w)`, not every default spelled out)."""
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return dict(kwargs)
    simple = (type(None), bool, int, float, str)

    def is_default(k: str, v: Any) -> bool:
        p = params.get(k)
        return p is not None and isinstance(v, simple) and type(v) is type(p.default) and v == p.default

    return {k: v for k, v in kwargs.items() if not is_default(k, v)}


def batch_dim(node: torch.fx.Node, depth: int = 8) -> tuple[int, int] | None:
    """(dim, rows per microbatch row) of a tensor that follows the batch ([Note: free
    batch]).  A node tensor parallelism inserted (a collective, a shard) has no record: it
    keeps the batch dimension of the input it was made from, where the sizes agree."""
    if "batch_dim" in node.meta:
        return node.meta["batch_dim"]  # type: ignore[no-any-return]
    shape = node.meta["tensor_meta"].shape if "tensor_meta" in node.meta else None
    for src in node.all_input_nodes if depth else ():
        found = batch_dim(src, depth - 1) if "tensor_meta" in src.meta else None
        if found and shape is not None and len(src.meta["tensor_meta"].shape) == len(shape) \
                and src.meta["tensor_meta"].shape[found[0]] == shape[found[0]]:
            return found
    return None


def shape_comment(node: torch.fx.Node, batch: str = "") -> str:
    """`  # (batch, T, C)` for a tensor node, with the dtype when it is not float32; the
    dimension that follows the microbatch's rows is written with `batch` where the stage
    reads it ([Note: free batch]), else every size is the compiled one."""
    meta = node.meta.get("tensor_meta")
    if meta is None or not hasattr(meta, "shape"):
        return ""
    sizes = [str(d) for d in meta.shape]
    free = batch_dim(node) if batch else None
    if free is not None and free[0] < len(sizes):
        dim, coef = free
        sizes[dim] = batch if coef == 1 else f"{coef} * {batch}"
    dims = ", ".join(sizes)
    shape = f"({dims},)" if len(sizes) == 1 else f"({dims})"
    dtype = "" if meta.dtype == torch.float32 else f" {str(meta.dtype).replace('torch.', '')}"
    return f"  # {shape}{dtype}"
