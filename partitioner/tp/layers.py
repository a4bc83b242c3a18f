"""Built-in split rules for the layers with weights: linear, addmm/mm, embedding, attention.

Megatron-LM's pattern (Shoeybi et al. 2019, section 3) falls out of these rules and the
solver's costs: a column-split linear (weight rows split, output sharded on its last
dimension) feeds elementwise ops on the shards and then a row-split linear (weight columns
split, input sharded, partial sums all-reduced), so an MLP or an attention block needs one
all_reduce forward (the row split's) and one backward (`tp.copy` before the column split).
Attention is split by heads: q/k/v column-split, the head dimension sharded through the
views, `scaled_dot_product_attention` per head, the output projection row-split.  An
embedding is split over the vocabulary (masked lookup, then all_reduce) or over its width.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from ..ir import PARTIAL, REPLICATED, Layout
from .rules import SplitContext, Strategy, insert, split_rule

__all__: list[str] = []

aten = torch.ops.aten


def _collectives() -> Any:
    from runtime import tp  # the functions generated stages call

    return tp


def _add(node: torch.fx.Node, target: Any, args: tuple[Any, ...], suffix: str, like: torch.fx.Node | None,
         *, op: str = "call_function", meta: Any = None, share: float = 0.0) -> torch.fx.Node:
    """`<node>_<suffix> = target(*args)` right before `node`, shaped like `like` (or `meta`),
    taking `share` of `node`'s compute cost."""
    tensor_meta = meta if meta is not None else (like.meta.get("tensor_meta") if like is not None else None)
    return insert(node, target, args, f"{node.name}_{suffix}", tensor_meta, op=op, origin=(node.name, share))


def _become(node: torch.fx.Node, target: Any, args: tuple[Any, ...]) -> None:
    """Turn `node` itself into `target(*args)` (its users keep reading it)."""
    node.target, node.args, node.kwargs = target, args, {}
    node.meta["tp_origin"] = (node.name, 0.0)


# -- linear: F.linear / aten.linear (weight (out, in)) and aten.addmm / aten.mm (weight (in, out)) --


def _linear_parts(ctx: SplitContext) -> tuple[Any, Any, Any, int] | None:
    """(x, weight, bias, weight's output dim) of a linear-like node with a parameter weight."""
    t = ctx.node.target
    if t in (F.linear, aten.linear.default):
        x, w, b, out_dim = ctx.arg(0, "input"), ctx.arg(1, "weight"), ctx.arg(2, "bias"), 0
    elif t is aten.addmm.default and not ctx.node.kwargs:
        b, x, w, out_dim = ctx.arg(0), ctx.arg(1), ctx.arg(2), 1
    elif t is aten.mm.default:
        x, w, b, out_dim = ctx.arg(0), ctx.arg(1), None, 1
    else:
        return None
    if not ctx.is_param(w) or ctx.ndim(w) != 2 or ctx.shape(x) is None:
        return None
    if b is not None and not (ctx.is_param(b) and ctx.ndim(b) == 1):
        return None
    return x, w, b, out_dim


@split_rule(F.linear, aten.linear.default, aten.addmm.default, aten.mm.default)
def linear(ctx: SplitContext) -> list[Strategy]:
    parts = _linear_parts(ctx)
    if parts is None:
        return []
    x, w, b, out_dim = parts
    wshape = ctx.shape(w)
    assert wshape is not None
    outs, ins, last = wshape[out_dim], wshape[1 - out_dim], ctx.ndim(x) - 1
    found = []
    for blocks in ctx.blocks:
        if ctx.divides(outs, blocks):  # column: the output features split
            layouts = {w: Layout(out_dim, blocks)} | ({b: Layout(0, blocks)} if b is not None else {})
            name = "linear.column" + (f"x{blocks}" if blocks > 1 else "")
            found.append(ctx.strategy(name, Layout(ctx.ndim() - 1, blocks), layouts))
    if ctx.divides(ins):  # row: the input features split, partial sums all-reduced ...
        found.append(ctx.strategy("linear.row", REPLICATED, {x: Layout(last), w: Layout(1 - out_dim)},
                                  reduce=True, rewrite=_row_rewrite))
        # ... or left partial, for the solver to reduce (all_reduce) or reduce-scatter later
        found.append(ctx.strategy("linear.row_partial", PARTIAL, {x: Layout(last), w: Layout(1 - out_dim)},
                                  rewrite=_bias_once if b is not None else None))
    return found


def _bias_once(node: torch.fx.Node, strategy: Strategy, tp: int) -> None:
    """A partial sum gets the bias once: on the group's first rank (`tp.first_rank`)."""
    tpc = _collectives()
    at = 0 if node.target is aten.addmm.default else 2
    positional = at < len(node.args)
    bias = node.args[at] if positional else node.kwargs["bias"]
    once = _add(node, tpc.first_rank, (bias,), "bias", bias)  # type: ignore[arg-type]
    if positional:
        node.args = (*node.args[:at], once, *node.args[at + 1:])
    else:
        node.kwargs = {**node.kwargs, "bias": once}


def _row_rewrite(node: torch.fx.Node, strategy: Strategy, tp: int) -> None:
    """`y = x W^T + b` on input shards: `y = all_reduce(x_t W_t^T) + b` (bias added once)."""
    tpc = _collectives()
    t = node.target
    if t is aten.addmm.default:
        b, x, w = node.args[:3]
        partial = _add(node, aten.mm.default, (x, w), "partial", node, share=1.0)
        add: Any = aten.add.Tensor
    else:
        x, w = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs["weight"]
        b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        if t is aten.mm.default:
            b = None
        partial = _add(node, t, (x, w), "partial", node, share=1.0)
        add = operator.add if t is F.linear else aten.add.Tensor
    if b is None:
        _become(node, tpc.all_reduce, (partial,))
        return
    summed = _add(node, tpc.all_reduce, (partial,), "sum", node)
    _become(node, add, (summed, b))


# -- embedding: F.embedding(ids, weight) / aten.embedding(weight, ids) ------------------------


def _embedding_parts(ctx: SplitContext) -> tuple[Any, Any] | None:
    t = ctx.node.target
    if t is F.embedding:
        ids, w = ctx.arg(0, "input"), ctx.arg(1, "weight")
        plain = all(ctx.node.kwargs.get(k) in (None, False) for k in ("padding_idx", "max_norm", "sparse"))
        plain = plain and len(ctx.node.args) <= 2
    else:
        w, ids = ctx.arg(0), ctx.arg(1)
        plain = ctx.arg(2, "padding_idx", -1) == -1 and not ctx.arg(4, "sparse", False)
    return (ids, w) if plain and ctx.is_param(w) and ctx.ndim(w) == 2 else None


@split_rule(F.embedding, aten.embedding.default)
def embedding(ctx: SplitContext) -> list[Strategy]:
    parts = _embedding_parts(ctx)
    if parts is None:
        return []
    ids, w = parts
    shape = ctx.shape(w)
    assert shape is not None
    found = []
    if ctx.divides(shape[1]):  # the width split: each rank looks up its columns
        found.append(ctx.strategy("embedding.width", Layout(ctx.ndim() - 1), {w: Layout(1)}))
    if ctx.divides(shape[0]):  # the vocabulary split: masked lookup, all_reduce
        found.append(ctx.strategy("embedding.vocab", REPLICATED, {w: Layout(0)}, reduce=True, rewrite=_vocab_rewrite))
    return found


def _vocab_rewrite(node: torch.fx.Node, strategy: Strategy, tp: int) -> None:
    """Rows [t*V/tp, (t+1)*V/tp) on rank t: ids outside them look up row 0 and are zeroed."""
    tpc = _collectives()
    f_style = node.target is F.embedding
    ids, w = (node.args[0], node.args[1]) if f_style else (node.args[1], node.args[0])
    rows = int(w.meta["tensor_meta"].shape[0]) // tp  # type: ignore[union-attr]
    ids_meta = ids.meta["tensor_meta"]  # type: ignore[union-attr]
    vocab = _add(node, tpc.vocab_shard, (ids, rows), "vocab", None)
    local = _add(node, operator.getitem, (vocab, 0), "ids", ids)  # type: ignore[arg-type]
    outside = _add(node, operator.getitem, (vocab, 1), "outside", None,
                     meta=ids_meta._replace(dtype=torch.bool, requires_grad=False))
    partial = _add(node, node.target, (local, w) if f_style else (w, local), "partial", node, share=1.0)
    out_meta = node.meta["tensor_meta"]
    column = _add(node, "unsqueeze", (outside, -1), "outside_col", None, op="call_method",
                    meta=out_meta._replace(shape=torch.Size([*ids_meta.shape, 1]), dtype=torch.bool, requires_grad=False))
    masked = _add(node, "masked_fill", (partial, column, 0.0), "masked", node, op="call_method")
    _become(node, tpc.all_reduce, (masked,))


# -- attention and batched matmuls -------------------------------------------------------------


@split_rule(F.scaled_dot_product_attention, aten.scaled_dot_product_attention.default)
def attention(ctx: SplitContext) -> list[Strategy]:
    """(B, heads, T, hs) q/k/v split by heads; a mask broadcast over heads stays whole."""
    q, k, v = ctx.arg(0, "query"), ctx.arg(1, "key"), ctx.arg(2, "value")
    mask = ctx.arg(3, "attn_mask")
    shapes = [ctx.shape(t) for t in (q, k, v)]
    if any(s is None or len(s) != 4 for s in shapes) or len({s[1] for s in shapes if s}) != 1:
        return []
    if ctx.node.kwargs.get("enable_gqa") or not ctx.divides(shapes[0][1]):  # type: ignore[index]
        return []
    layouts = {t: Layout(1) for t in (q, k, v)}
    if isinstance(mask, torch.fx.Node):
        mshape = ctx.shape(mask)
        if mshape is None:
            return []
        heads = mshape[len(mshape) - 3] if len(mshape) >= 3 else 1
        if heads != 1:
            layouts[mask] = Layout(len(mshape) - 3)
    return [ctx.strategy("attention.heads", Layout(1), layouts)]


@split_rule(operator.matmul, torch.matmul, aten.matmul.default, aten.bmm.default, "matmul", "bmm")
def batched_matmul(ctx: SplitContext) -> list[Strategy]:
    """a @ b with both operands activations of the same rank >= 3: split a batch dimension
    (the heads of q @ k^T)."""
    a, b = ctx.arg(0), ctx.arg(1)
    sa, sb, out = ctx.shape(a), ctx.shape(b), ctx.shape()
    if sa is None or sb is None or out is None or len(sa) != len(sb) or len(sa) < 3:
        return []
    if ctx.is_param(a) or ctx.is_param(b):
        return []
    return [ctx.strategy("matmul.batch", Layout(d), {a: Layout(d), b: Layout(d)})
            for d in range(len(sa) - 2) if sa[d] == sb[d] == out[d] and ctx.divides(out[d])]
