"""The model's inputs as leaves: each tensor of the example batch, at any depth, has a key and
a batch dimension.

[Note: input leaves]
    A model input may be a tensor or a tuple, list or dict of them at any depth
    (`forward(x, (h0, c0))`).  Every leaf is one graph input: a top-level value keeps the
    key it always had (its position, or its keyword), and a leaf inside a container is
    keyed by a tuple path, the top-level key first (`(1, 0)` is h0 of `(x, (h0, c0))`),
    which the manifest records as a JSON list and the runtime follows into the batch it is
    given.  Non-tensor leaves (ints, bools, None) are folded into the graph as constants.

    Each tensor leaf's batch dimension is 0 unless `BATCH_DIMS` says otherwise.  A
    BATCH_DIMS entry is keyed by an argument's position or name, or by a dotted path into
    it (`"hidden.0"`, `"1.0"`, `"feats.a.1"`), and gives an int (every tensor under that
    key) or a structure like the argument's (`{"hidden": (1, 1)}`).  An entry that names
    nothing, or whose structure is not the argument's, is a `ModelFileError`.

    The output may nest likewise (`(output, (h, c))`): every tensor leaf is joined across
    microbatches along its own batch dimension (the manifest's `output_batch_dims`): the
    free batch's where it is known ([Note: free batch]), else the one dimension of the
    microbatch's rows, else, of several, the batch dim of an input of the same shape (an
    LSTM's h0 gives h's), else the first of them.
"""

from __future__ import annotations

import dataclasses
import inspect
import operator
from typing import TYPE_CHECKING, Any, Callable, Union

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.fx._symbolic_trace import PH

from ..errors import ModelFileError

if TYPE_CHECKING:
    from .traced import Traced

__all__ = ["InputKey", "expand_outputs", "fix_placeholder", "flat_codegen", "flat_inputs", "forward_names", "key_text", "leaf_batch_dims", "leaves_of", "nested_placeholders",
           "output_batch_dims", "path_entry", "tops"]

#: a top-level input's position or keyword, or a path into it ([Note: input leaves])
InputKey = Union[int, str, tuple[Union[int, str], ...]]


def forward_names(model: torch.nn.Module) -> list[str]:
    """The names of `model.forward`'s parameters, in order."""
    return list(inspect.signature(model.forward).parameters)


def path_entry(k: Any) -> int | str:
    """One step of a pytree path as the key a user writes: a position or a dict key."""
    if isinstance(k, pytree.SequenceKey):
        return k.idx
    if isinstance(k, pytree.MappingKey):
        return k.key  # type: ignore[no-any-return]
    return str(getattr(k, "name", k))


def leaves_of(top: int | str, value: Any) -> list[tuple[InputKey, Any]]:
    """(key, leaf) for each leaf of one top-level input ([Note: input leaves])."""
    flat, _ = pytree.tree_flatten_with_path(value)
    return [(top if not path else (top, *(path_entry(k) for k in path)), leaf) for path, leaf in flat]


def flat_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[InputKey, Any]:
    """Every leaf of the batch by its key: positions, keywords, paths."""
    out: dict[InputKey, Any] = {}
    for top, value in tops(args, kwargs):
        out.update(leaves_of(top, value))
    return out


def tops(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[int | str, Any]]:
    """The batch's top-level values with their keys: positions, then keywords."""
    return [*((i, a) for i, a in enumerate(args)), *kwargs.items()]


def key_text(key: InputKey) -> str:
    """A key as BATCH_DIMS may write it: `0`, `'x'`, `'hidden.0'`."""
    return ".".join(map(str, key)) if isinstance(key, tuple) else repr(key)


def leaf_batch_dims(declared: dict[Any, Any], names: list[str], args: tuple[Any, ...], kwargs: dict[str, Any],
                    where: str) -> dict[InputKey, int]:
    """The batch dimension of every tensor leaf of the batch, from BATCH_DIMS `declared`
    ([Note: input leaves]); `names`: forward's parameter names, `where`: the model file."""
    keyed = dict(tops(args, kwargs))
    dims: dict[InputKey, int] = {}
    for raw, spec in declared.items():
        top, rest = _locate(raw, names, keyed, where)
        value, path = keyed[top], list[int | str]()
        for step in rest:
            value, typed = _step(value, step, raw, where)
            path.append(typed)
        prefix = (top, *path) if path else top
        dims.update(_spread(prefix, value, spec, raw, where))
    return dims


def _locate(raw: Any, names: list[str], keyed: dict[int | str, Any], where: str) -> tuple[int | str, list[str]]:
    """The top-level key a BATCH_DIMS entry names, and the path below it (still text)."""
    parts = raw.split(".") if isinstance(raw, str) else [raw]
    head, rest = parts[0], parts[1:]
    position = int(head) if isinstance(head, str) and head.isdigit() else head
    candidates: list[int | str] = [head, position]
    if isinstance(position, int) and 0 <= position < len(names):
        candidates.append(names[position])
    if isinstance(head, str) and head in names:
        candidates.append(names.index(head))
    for c in candidates:
        if c in keyed:
            return c, rest
    have = ", ".join(key_text(k) for k in keyed) or "nothing"
    raise ModelFileError(f"{where}: BATCH_DIMS names input {raw!r} but example_inputs() gives {have}: key "
                         f"BATCH_DIMS by an argument's position or name, or a dotted path into it "
                         f"(e.g. {{'hidden.0': 1}}).")


def _step(value: Any, step: str, raw: Any, where: str) -> tuple[Any, int | str]:
    """`value[step]` and the step as a key, read as an index for a tuple or list."""
    try:
        if isinstance(value, (tuple, list)):
            return value[int(step)], int(step)
        if isinstance(value, dict):
            return value[step], step
    except (ValueError, IndexError, KeyError):
        pass
    raise ModelFileError(f"{where}: BATCH_DIMS path {raw!r} stops at {step!r}, which the input "
                         f"({_shape_text(value)}) does not have: give a path of positions and dict keys into it.")


def _spread(prefix: InputKey, value: Any, spec: Any, raw: Any, where: str) -> dict[InputKey, int]:
    """Each tensor leaf under `value` (at key `prefix`) with its dim from `spec`: one int for
    all, or a structure like `value`'s."""
    top, base = (prefix[0], prefix[1:]) if isinstance(prefix, tuple) else (prefix, ())
    if isinstance(spec, int) and not isinstance(spec, bool):
        return {_join(top, base, k): spec for k, leaf in leaves_of(0, value) if isinstance(leaf, torch.Tensor)}
    got, want = pytree.tree_flatten(_tuples(spec))[1], pytree.tree_flatten(_tuples(value))[1]
    if got != want or not all(d is None or (isinstance(d, int) and not isinstance(d, bool)) for d in pytree.tree_leaves(spec)):
        raise ModelFileError(f"{where}: BATCH_DIMS[{raw!r}] is {spec!r} but the input is {_shape_text(value)}: give "
                             f"one int for every tensor in it, or the same structure with an int per tensor.")
    pairs = zip(leaves_of(0, value), pytree.tree_leaves(spec))
    return {_join(top, base, k): d for (k, leaf), d in pairs if isinstance(leaf, torch.Tensor) and d is not None}


def _tuples(value: Any) -> Any:
    """`value` with its lists as tuples: BATCH_DIMS may write `[1, 1]` for a tuple input."""
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return tuple(_tuples(v) for v in value)
    if isinstance(value, dict):
        return {k: _tuples(v) for k, v in value.items()}
    return value


def _join(top: int | str, base: tuple[Any, ...], sub: InputKey) -> InputKey:
    """The key of a leaf at path `sub` (from `leaves_of(0, ...)`) below `top` + `base`."""
    rest = (*base, *(sub[1:] if isinstance(sub, tuple) else ()))
    return (top, *rest) if rest else top


def _shape_text(value: Any) -> str:
    """A value's structure with tensor shapes: `(tensor[3, 8, 12], tensor[3, 8, 12])`."""
    shown = pytree.tree_map(lambda v: f"tensor{list(v.shape)}" if isinstance(v, torch.Tensor) else v, value)
    return str(shown).replace("'", "")


def output_batch_dims(leaves: list[Any], rows: int, inputs: dict[tuple[int, ...], int]) -> tuple[int | None, ...]:
    """The batch dim of each output leaf (fx nodes after `propagate`) of a microbatch of
    `rows` rows; `inputs`: the input leaves' batch dims by shape ([Note: input leaves])."""
    return tuple(_output_dim(leaf, rows, inputs) for leaf in leaves)


def _output_dim(leaf: Any, rows: int, inputs: dict[tuple[int, ...], int]) -> int | None:
    meta = getattr(leaf, "meta", {})
    if meta.get("batch_dim") is not None:
        return int(meta["batch_dim"][0])
    shape = tuple(meta["tensor_meta"].shape) if meta.get("tensor_meta") is not None else ()
    if not shape:
        return None
    fits = [d for d, n in enumerate(shape) if n == rows]
    if len(fits) > 1 and inputs.get(shape) in fits:
        return inputs[shape]
    return fits[0] if fits else 0


# -- fx: nested inputs and outputs as graph leaves ------------------------------------------


def nested_placeholders(given: dict[str, Any]) -> dict[str, Any]:
    """fx's `concrete_args` for the arguments given as containers: their structure with a
    placeholder at every tensor leaf and the value itself at every other leaf, which the
    model then sees (fx still makes a guarded placeholder for it, `fix_placeholder` drops)."""
    return {name: pytree.tree_map(lambda v: PH if isinstance(v, torch.Tensor) else v, value)
            for name, value in given.items() if not pytree.tree_is_leaf(value)}


def flat_codegen(graph: torch.fx.Graph) -> None:
    """The graph's code made plain again where fx traced nested inputs (its `_PyTreeCodeGen`
    takes and returns structures; the stages and the compiler call it with flat leaves, and
    the output's structure is the tracer's: [Note: output classes] in outputs.py)."""
    if getattr(graph._codegen, "pytree_info", None) is not None:
        graph._codegen = torch.fx.graph.CodeGen()


def fix_placeholder(gm: torch.fx.GraphModule, node: torch.fx.Node, name: str, value: Any,
                    default: Callable[[torch.fx.GraphModule, torch.fx.Node, str, Any], Any]) -> None:
    """Replace the placeholder of an argument (or leaf of one) fixed to `value` by
    `default(gm, node, name, value)`, and drop the guards fx put on it."""
    for user in list(node.users):
        for guard in list(user.users):
            if "_assert" in getattr(guard.target, "__name__", ""):
                gm.graph.erase_node(guard)
        if "_assert" in getattr(user.target, "__name__", "") or (user.target is operator.eq and not user.users):
            gm.graph.erase_node(user)
    node.replace_all_uses_with(default(gm, node, name, value))
    gm.graph.erase_node(node)


def expand_outputs(traced: Traced, values: dict[torch.fx.Node, Any]) -> Traced:
    """An output leaf whose value is a tuple or list (a kept module's `(h, c)`) becomes one
    getitem node per element, so that each output leaf is one tensor with its own shape and
    batch dim ([Note: input leaves] in inputs.py); one whose value is None (a field of a
    ModelOutput read from a kept module's output, unset) becomes None, as the model returns
    it; the output's structure follows."""
    graph = traced.gm.graph
    out = next(n for n in graph.nodes if n.op == "output")
    if not any(type(values.get(x)) in (tuple, list) or (x in values and values[x] is None)
               for x in traced.output_leaves if isinstance(x, torch.fx.Node)):
        return traced
    with graph.inserting_before(out):
        split = [_split_leaf(graph, x, values.get(x)) if isinstance(x, torch.fx.Node) else x
                 for x in traced.output_leaves]
    leaves, spec = pytree.tree_flatten(pytree.tree_unflatten(split, traced.out_spec))
    out.args = (leaves,)  # the graph returns its leaves; the structure is `out_spec` ([Note: output classes])
    traced.gm.recompile()
    return dataclasses.replace(traced, out_spec=spec, output_leaves=leaves)


def _split_leaf(graph: torch.fx.Graph, node: torch.fx.Node, value: Any) -> Any:
    """`node` as a structure of getitem nodes shaped like its tuple or list `value`; None
    for None."""
    if value is None:
        return None
    if type(value) not in (tuple, list):  # a namedtuple keeps its type: one leaf
        return node
    return type(value)(_split_leaf(graph, graph.call_function(operator.getitem, (node, i)), v)
                       for i, v in enumerate(value))
