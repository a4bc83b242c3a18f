"""Built-in split rules that carry a layout through: elementwise ops, views and permutes,
splits, normalisations and reductions over other dimensions.

Each keeps the work of the node on the shards of its input (time / tp) and says which
dimension of its output is then sharded.  Shape arguments fixed at trace time (`view(6, 8,
4, 8)`) are rewritten to the shard's sizes (`view(6, 8, 2, 8)`), with -1 kept as -1.
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import torch
import torch.fx
import torch.nn.functional as F

from ..ir import Layout
from .rules import SplitContext, Strategy, register_many, split_rule

__all__: list[str] = []

aten = torch.ops.aten

_OPERATORS = [operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
              operator.and_, operator.or_, operator.eq, operator.ne, operator.lt, operator.le, operator.gt,
              operator.ge, operator.invert]
_SAME_SHAPE = ["contiguous", "clone", "to", "float", "half", "bfloat16", "double", "type", "type_as", "detach",
               "dropout", "alias", "_to_copy", "masked_fill", "where", "gelu", "relu", "silu", "tanh", "sigmoid"]


def _pointwise_targets() -> list[Any]:
    """Elementwise call targets: Python operators, torch/F functions and tensor methods whose
    aten op is tagged pointwise, and same-shape ops (dropout, casts, copies)."""
    targets: list[Any] = list(_OPERATORS)
    for name in _SAME_SHAPE + ["add", "sub", "mul", "div", "neg", "pow", "exp", "log", "sqrt", "rsqrt", "erf",
                               "abs", "cos", "sin", "softplus", "mish", "leaky_relu", "elu", "hardtanh"]:
        targets.append(name)  # the tensor method
        for namespace in (torch, F):
            fn = getattr(namespace, name, None)
            if callable(fn):
                targets.append(fn)
    for op in (aten.dropout.default, aten.alias.default, aten.detach.default, aten._to_copy.default,
               aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.contiguous.default, aten.type_as.default):
        targets.append(op)
    return targets


def pointwise(ctx: SplitContext) -> list[Strategy]:
    """An elementwise op (with broadcasting) split along any dimension of its output: an
    input of full size there is sharded alike, one broadcast along it stays whole."""
    out = ctx.shape()
    if out is None:
        return []
    found = []
    for blocks in ctx.blocks:
        for d in range(len(out)):
            if not ctx.divides(out[d], blocks):
                continue
            layouts = _aligned(ctx, out, d, blocks)
            if layouts is not None:
                found.append(ctx.strategy(f"pointwise.S{d}", Layout(d, blocks), layouts))
    return found


def _aligned(ctx: SplitContext, out: tuple[int, ...], d: int, blocks: int) -> dict[torch.fx.Node, Layout] | None:
    layouts: dict[torch.fx.Node, Layout] = {}
    for a in ctx.inputs:
        shape = ctx.shape(a)
        if shape is None:
            return None
        k = d - (len(out) - len(shape))
        if k < 0 or shape[k] == 1:
            continue  # broadcast along d: whole on every rank
        if shape[k] != out[d]:
            return None
        layouts[a] = Layout(k, blocks)
    return layouts or None


register_many(["pointwise", *_pointwise_targets()], pointwise)


# -- views ---------------------------------------------------------------------------------------


def _groups(ins: Sequence[int], outs: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Dimensions of a view paired into groups of equal product (row-major order)."""
    groups, i, j = [], 0, 0
    while i < len(ins) or j < len(outs):
        gi, gj, pi, pj = [], [], 1, 1
        if i < len(ins):
            gi, pi, i = [i], ins[i], i + 1
        if j < len(outs):
            gj, pj, j = [j], outs[j], j + 1
        while pi != pj and (i < len(ins) or j < len(outs)):
            if (pi < pj and i < len(ins)) or j >= len(outs):
                gi.append(i)
                pi, i = pi * ins[i], i + 1
            else:
                gj.append(j)
                pj, j = pj * outs[j], j + 1
        groups.append((gi, gj))
    return groups


def view_map(ins: Sequence[int], outs: Sequence[int], d: int, parts: int, blocks: int = 1) -> int | None:
    """The output dimension sharded when input dimension `d` is cut into `parts` contiguous
    pieces, or None when the shards are not contiguous in the output."""
    for gi, gj in _groups(ins, outs):
        if d not in gi:
            continue
        big_in = [k for k in gi if ins[k] > 1]
        big_out = [k for k in gj if outs[k] > 1]
        if not big_in or big_in[0] != d or not big_out or outs[big_out[0]] % (parts * blocks):
            return None
        if blocks > 1 and (len(big_in) != 1 or len(big_out) != 1):
            return None
        return big_out[0]
    return None


def _sizes_arg(node: torch.fx.Node) -> tuple[str, Any]:
    """Where a view/reshape/expand keeps its sizes: ('list', [..]) in args[1], or ('varargs', args[1:])."""
    if node.op == "call_method" and not (len(node.args) == 2 and isinstance(node.args[1], (list, tuple))):
        return "varargs", list(node.args[1:])
    sizes: Any = node.args[1] if len(node.args) > 1 else next(iter(node.kwargs.values()))
    return "list", list(sizes)


def _shrink(size: Any, local: int) -> Any:
    """`size` cut to `local`, by division, so a size that follows the batch still does
    ([Note: free batch] in partitioner/trace/batch.py)."""
    return size // (int(size) // local) if local and int(size) % local == 0 else local


def _localize_sizes(node: torch.fx.Node, strategy: Strategy, tp: int) -> None:
    """Write the shard's sizes into the node's size arguments (-1 stays -1)."""
    shape = tuple(int(s) for s in node.meta["tensor_meta"].shape)
    local = strategy.output.local_shape(shape, tp)
    kind, sizes = _sizes_arg(node)
    new = [s if s == -1 or s == local[i] else _shrink(s, local[i]) for i, s in enumerate(sizes)]
    if kind == "varargs":
        node.args = (node.args[0], *new)
    elif len(node.args) > 1:
        container: Any = type(node.args[1])
        node.args = (node.args[0], container(new), *node.args[2:])
    else:
        key = next(iter(node.kwargs))
        node.kwargs = {**node.kwargs, key: new}


@split_rule(aten.view.default, aten.reshape.default, aten._unsafe_view.default, torch.reshape, "view", "reshape")
def view(ctx: SplitContext) -> list[Strategy]:
    x = ctx.arg(0)
    ins, outs = ctx.shape(x), ctx.shape()
    if ins is None or outs is None:
        return []
    found = []
    for blocks in ctx.blocks:
        for d in range(len(ins)):
            if ins[d] % (ctx.tp * blocks):
                continue
            o = view_map(ins, outs, d, ctx.tp, blocks)
            if o is not None:
                found.append(ctx.strategy(f"view.S{d}", Layout(o, blocks), {x: Layout(d, blocks)},
                                          rewrite=_localize_sizes))
    return found


@split_rule(aten.expand.default, "expand")
def expand(ctx: SplitContext) -> list[Strategy]:
    x = ctx.arg(0)
    ins, outs = ctx.shape(x), ctx.shape()
    if ins is None or outs is None:
        return []
    lead = len(outs) - len(ins)
    return [ctx.strategy(f"expand.S{d}", Layout(d + lead), {x: Layout(d)}, rewrite=_localize_sizes)
            for d in range(len(ins)) if ins[d] == outs[d + lead] and ctx.divides(ins[d])]


def _moved(ctx: SplitContext, where: Any) -> list[Strategy]:
    """Strategies for an op that moves dimensions: `where(d)` is input d's output dimension."""
    x = ctx.arg(0)
    ins = ctx.shape(x)
    if ins is None:
        return []
    found = []
    for blocks in ctx.blocks:
        for d in range(len(ins)):
            o = where(d)
            if o is not None and ctx.divides(ins[d], blocks):
                found.append(ctx.strategy(f"{_name(ctx.node)}.S{d}", Layout(o, blocks), {x: Layout(d, blocks)}))
    return found


def _name(node: torch.fx.Node) -> str:
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", str(target)).split(".")[0]


@split_rule(aten.transpose.int, torch.transpose, "transpose")
def transpose(ctx: SplitContext) -> list[Strategy]:
    n = ctx.ndim(ctx.arg(0))
    a, b = int(ctx.arg(1, "dim0")) % n, int(ctx.arg(2, "dim1")) % n
    return _moved(ctx, lambda d: b if d == a else a if d == b else d)


@split_rule(aten.t.default, torch.t, "t")
def transpose_2d(ctx: SplitContext) -> list[Strategy]:
    return _moved(ctx, lambda d: 1 - d)


@split_rule(aten.permute.default, torch.permute, "permute")
def permute(ctx: SplitContext) -> list[Strategy]:
    n = ctx.ndim(ctx.arg(0))
    dims: Any = ctx.node.args[1:] if ctx.node.op == "call_method" and not isinstance(ctx.arg(1), (list, tuple)) else ctx.arg(1, "dims")
    order = [int(k) % n for k in dims]
    return _moved(ctx, lambda d: order.index(d))


@split_rule(aten.unsqueeze.default, torch.unsqueeze, "unsqueeze")
def unsqueeze(ctx: SplitContext) -> list[Strategy]:
    at = int(ctx.arg(1, "dim")) % (ctx.ndim(ctx.arg(0)) + 1)
    return _moved(ctx, lambda d: d if d < at else d + 1)


@split_rule(aten.squeeze.dim, "squeeze")
def squeeze(ctx: SplitContext) -> list[Strategy]:
    if ctx.arg(1, "dim") is None:
        return []
    at = int(ctx.arg(1, "dim")) % ctx.ndim(ctx.arg(0))
    return _moved(ctx, lambda d: None if d == at else d if d < at else d - 1)


@split_rule(aten.slice.Tensor)
def slice_(ctx: SplitContext) -> list[Strategy]:
    at = int(ctx.arg(1, "dim", 0)) % ctx.ndim(ctx.arg(0))
    return _moved(ctx, lambda d: None if d == at else d)


# -- splits and concatenation ----------------------------------------------------------------------


def _split_rewrite(node: torch.fx.Node, strategy: Strategy, tp: int) -> None:
    """Split sizes along the sharded dimension become the shard's."""
    size: Any = node.args[1]
    local = [s // tp for s in size] if isinstance(size, (list, tuple)) else size // tp
    node.args = (node.args[0], local, *node.args[2:])


@split_rule(aten.split.Tensor, aten.split_with_sizes.default, torch.split, "split")
def split(ctx: SplitContext) -> list[Strategy]:
    """Pieces keep a layout on another dimension; a dimension of b blocks split into its b
    blocks gives pieces sharded plainly (the fused q/k/v projection)."""
    x = ctx.arg(0)
    ins = ctx.shape(x)
    if ins is None:
        return []
    at = int(ctx.arg(2, "dim", 0)) % len(ins)
    size = ctx.arg(1, "split_size_or_sections" if ctx.node.op == "call_function" else "split_size")
    if size is None:
        size = ctx.arg(1, "split_size_or_sections")
    sizes = list(size) if isinstance(size, (list, tuple)) else [int(size)] * -(-ins[at] // int(size))
    found = [ctx.strategy(f"split.S{d}", Layout(d), {x: Layout(d)}) for d in range(len(ins))
             if d != at and ctx.divides(ins[d])]
    equal = len(set(sizes)) == 1 and sum(sizes) == ins[at]
    if len(sizes) in ctx.blocks and len(sizes) > 1 and equal and ctx.divides(sizes[0]):
        found.append(ctx.strategy("split.blocks", Layout(at), {x: Layout(at, len(sizes))}, rewrite=_split_rewrite))
    return found


@split_rule(operator.getitem)
def getitem(ctx: SplitContext) -> list[Strategy]:
    """An element of a split's tuple has the tuple's layout (indexing a tensor: replicated)."""
    source = ctx.arg(0)
    if not isinstance(source, torch.fx.Node) or ctx.shape(source) is not None or not isinstance(ctx.arg(1), int):
        return []
    out = ctx.shape()
    if out is None:
        return []
    return [ctx.strategy(f"getitem.S{d}", Layout(d), {source: Layout(d)}) for d in range(len(out)) if ctx.divides(out[d])]


@split_rule(aten.cat.default, torch.cat, torch.concat)
def cat(ctx: SplitContext) -> list[Strategy]:
    tensors = ctx.arg(0, "tensors")
    out = ctx.shape()
    if out is None or not isinstance(tensors, (list, tuple)) or not all(isinstance(t, torch.fx.Node) for t in tensors):
        return []
    at = int(ctx.arg(1, "dim", 0)) % len(out)
    found = []
    for d in range(len(out)):
        shapes = [ctx.shape(t) for t in tensors]
        if d != at and ctx.divides(out[d]) and all(s is not None and len(s) == len(out) and s[d] == out[d] for s in shapes):
            found.append(ctx.strategy(f"cat.S{d}", Layout(d), {t: Layout(d) for t in tensors}))
    return found


# -- normalisations and reductions over other dimensions ---------------------------------------------


def _keep_dims(ctx: SplitContext, reduced: set[int], keepdim: bool) -> list[Strategy]:
    """The input sharded on a dimension that is not reduced; the output keeps it (shifted
    when reduced dimensions before it are dropped)."""
    x = ctx.arg(0)
    ins = ctx.shape(x)
    if ins is None or ctx.shape() is None:
        return []
    found = []
    for d in range(len(ins)):
        if d in reduced or not ctx.divides(ins[d]):
            continue
        o = d if keepdim else d - sum(1 for r in reduced if r < d)
        found.append(ctx.strategy(f"{_name(ctx.node)}.S{d}", Layout(o), {x: Layout(d)}))
    return found


@split_rule(F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, aten._softmax.default, aten.softmax.int,
            aten._log_softmax.default, aten.log_softmax.int, "softmax", "log_softmax")
def softmax(ctx: SplitContext) -> list[Strategy]:
    dim = ctx.arg(1, "dim")
    if dim is None:
        return []
    return _keep_dims(ctx, {int(dim) % ctx.ndim(ctx.arg(0))}, True)


@split_rule(F.layer_norm, aten.layer_norm.default, F.rms_norm, aten.rms_norm.default)
def layer_norm(ctx: SplitContext) -> list[Strategy]:
    """Normalised over the last dimensions; weight and bias whole, the others may be split."""
    n = ctx.ndim(ctx.arg(0))
    normalized = ctx.arg(1, "normalized_shape")
    k = len(normalized) if isinstance(normalized, (list, tuple)) else 1
    return _keep_dims(ctx, set(range(n - k, n)), True)


@split_rule(aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, torch.mean, torch.sum, "mean", "sum")
def reduction(ctx: SplitContext) -> list[Strategy]:
    n = ctx.ndim(ctx.arg(0))
    dims = ctx.arg(1, "dim")
    if dims is None or n == 0:
        return []
    dims = [dims] if isinstance(dims, int) else list(dims)
    return _keep_dims(ctx, {int(d) % n for d in dims}, bool(ctx.arg(2, "keepdim", False)))

