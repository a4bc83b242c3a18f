"""Rewrite a traced graph into the graph ONE tensor-parallel rank runs, with its costs.

For the chosen strategy of every node, in graph order:
  1. convert each input from the layout its producer gives to the one the strategy needs
     (`tp.all_gather` to make a shard whole, `tp.scatter` to take this rank's shard), once
     per value and layout, right before its first reader;
  2. pass an R input that the node reads for a partial gradient through `tp.copy`, once
     per value (see [Note: layouts and gradients] in rules.py);
  3. let the strategy rewrite the node (local shape arguments; a row split's all_reduce);
  4. give the node its local shape (`tensor_meta`) and layout (`tp_layout`) and, once all
     are written, its cost on one rank (returned by node name, as cost/profile.py's `annotate` returns them).
The output is made whole (the loss reads it).  Parameters keep their names; the layout
of each is returned, for the code generator to build shards and the runtime to load them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx

from ..cost.hardware import Hardware
from ..cost.waves import shard_factor
from ..ir import REPLICATED, Layout, NodeCost
from ..trace.traced import graph_module
from .problem import ShardingReport
from .pose import PAIRS, Posed, call_s, needs_grad, value_bytes
from .rules import Strategy, insert
from .saved import rank_saved_bytes, reads_whole_activation

__all__ = ["Sharded", "rewrite"]


@dataclass
class Sharded:
    """A graph as one tensor-parallel rank runs it."""

    gm: torch.fx.GraphModule
    costs: dict[str, NodeCost]
    params: dict[str, Layout]  # parameter target -> its layout (sharded ones)
    tp: int
    rules: dict[str, str] = field(default_factory=dict)  # split node -> rule
    collectives: dict[str, int] = field(default_factory=dict)  # kind -> count in the graph
    report: ShardingReport | None = None


def rewrite(gm: torch.fx.GraphModule, posed: Posed, choice: tuple[int, ...], costs: dict[str, NodeCost], tp: int,
            hardware: Hardware) -> Sharded:
    """The local graph for one strategy per variable of `posed`."""
    from runtime import tp as collectives

    graph = copy.deepcopy(gm.graph)  # rewritten, then compiled into the rank's module once
    chosen = {name: posed.strategies[v][choice[v]] for v, name in enumerate(posed.variables)}
    params = {str(n.target): chosen[str(n.target)].output for n in graph.nodes if n.op == "get_attr"}
    layout: dict[torch.fx.Node, Layout] = {}
    made: dict[tuple[str, object], torch.fx.Node] = {}
    strategy_of: dict[str, Strategy] = {}
    for n in list(graph.nodes):
        if n.op == "get_attr":
            layout[n] = params[str(n.target)]
            continue
        s = chosen[n.name]
        strategy_of[n.name] = s
        for p, a in enumerate(list(n.all_input_nodes)):
            want, value = s.inputs[p], a
            if a.op != "get_attr" and layout[a] != want:  # 1. convert
                value = _converted(a, layout[a], want, n, tp, made, collectives)
            if want.replicated and p in s.partial_inputs() and needs_grad(a):  # 2. copy
                whole = value
                value = _once(made, (a.name, "copy"), lambda: insert(
                    n, collectives.copy, (whole,), f"{a.name}_copy", whole.meta.get("tensor_meta")))
            if value is not a:
                n.replace_input_with(a, value)
        if s.rewrite is not None:  # 3. the strategy's own rewrite
            s.rewrite(n, s, tp)
        layout[n] = s.output
        n.meta["tp_layout"] = s.output  # codegen gives a sharded value's dropout its rank's stream
        _localize(n, s.output, tp)  # 4. local shape
    local = graph_module(gm, graph)
    local.graph.lint()
    rules = {name: s.rule for name, s in strategy_of.items() if s.rule not in ("replicate", "input", "output")}
    rank = _Rank(strategy_of, tp, hardware, collectives, {n.name: _shape(n) for n in gm.graph.nodes}, params)
    node_costs = _local_costs(local, costs, rank)
    kinds = _count(local, collectives)
    return Sharded(local, node_costs, {k: v for k, v in params.items() if not v.replicated}, tp, rules, kinds)


def _once(made: dict[tuple[str, object], torch.fx.Node], key: tuple[str, object],
          build: Callable[[], torch.fx.Node]) -> torch.fx.Node:
    if key not in made:
        made[key] = build()
    return made[key]


def _converted(a: torch.fx.Node, have: Layout, want: Layout, reader: torch.fx.Node, tp: int,
               made: dict[tuple[str, object], torch.fx.Node], collectives: Any) -> torch.fx.Node:
    """`a` in layout `want`: gathered whole, then this rank's shard taken, as needed; a
    partial sum all-reduced, or reduce-scattered straight into the shard."""
    if have.partial and not want.replicated:
        return _once(made, (a.name, want), lambda: insert(
            reader, collectives.reduce_scatter, (a, want.dim), f"{a.name}_shard",
            _local_meta(a.meta.get("tensor_meta"), want, tp), kwargs=_blocks(want)))
    if have.partial:
        return _once(made, (a.name, REPLICATED), lambda: insert(
            reader, collectives.all_reduce, (a,), f"{a.name}_sum", a.meta.get("tensor_meta")))
    whole = a
    if not have.replicated:
        whole = _once(made, (a.name, REPLICATED), lambda: insert(
            reader, collectives.all_gather, (a, have.dim), f"{a.name}_whole", a.meta.get("tensor_meta"),
            kwargs=_blocks(have)))
        whole.meta["tensor_meta"] = _global_meta(a, have, tp)
    if want.replicated:
        return whole
    return _once(made, (a.name, want), lambda: insert(
        reader, collectives.scatter, (whole, want.dim), f"{a.name}_shard",
        _local_meta(whole.meta.get("tensor_meta"), want, tp), kwargs=_blocks(want)))


def _blocks(layout: Layout) -> dict[str, int] | None:
    """The `blocks=` keyword of a tp.* call, written only when it is not 1."""
    return {"blocks": layout.blocks} if layout.blocks > 1 else None


def _global_meta(a: torch.fx.Node, have: Layout, tp: int) -> Any:
    meta = a.meta.get("tensor_meta")
    if meta is None or have.replicated:
        return meta
    shape = list(meta.shape)
    shape[have.dim] *= tp  # type: ignore[index]
    return meta._replace(shape=torch.Size(shape))


def _local_meta(meta: Any, lay: Layout, tp: int) -> Any:
    if meta is None or lay.replicated or not hasattr(meta, "shape"):
        return meta
    return meta._replace(shape=torch.Size(lay.local_shape(tuple(meta.shape), tp)))


def _localize(node: torch.fx.Node, lay: Layout, tp: int) -> None:
    meta = node.meta.get("tensor_meta")
    if meta is not None and hasattr(meta, "shape"):
        node.meta["tensor_meta"] = _local_meta(meta, lay, tp)


# -- costs on one rank -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Rank:
    """What costing one rank's nodes reads: each original node's strategy and output shape
    (`whole`), the degree, the hardware, the collectives module and each weight's layout."""

    strategy_of: dict[str, Strategy]
    tp: int
    hardware: Hardware
    collectives: Any
    whole: dict[str, tuple[int, ...] | None]
    params: dict[str, Layout]


def _local_costs(gm: torch.fx.GraphModule, costs: dict[str, NodeCost], rank: _Rank) -> dict[str, NodeCost]:
    """Each compute node's cost on one rank, by node name."""
    out: dict[str, NodeCost] = {}
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method", "call_module"):
            out[n.name] = _local_cost(n, costs, rank)
    return out


def _shape(n: torch.fx.Node) -> tuple[int, ...] | None:
    shape = getattr(n.meta.get("tensor_meta"), "shape", None)
    return tuple(shape) if shape is not None else None


def _local_cost(n: torch.fx.Node, costs: dict[str, NodeCost], rank: _Rank) -> NodeCost:
    kind = _kind(n, rank.collectives)
    if kind is not None:
        return _collective_cost(n, kind, rank.tp, rank.hardware)
    origin, share = n.meta.get("tp_origin", (n.name, 1.0))
    base = costs.get(origin)
    s = rank.strategy_of.get(origin)
    if base is None or s is None:
        return NodeCost(n.name, output_bytes=value_bytes(n))
    f = share / rank.tp if s.sharded else share
    t = f  # the shard's product runs its own waves ([Note: waves of tiles])
    if s.sharded and base.flops:
        t *= shard_factor(rank.whole.get(origin), _shape(n), any(a.op == "get_attr" for a in n.all_input_nodes),
                          rank.hardware)
    saved = None  # [Note: saved bytes on a tp rank]
    if s.sharded and base.activation_bytes and reads_whole_activation(n, s.inputs):
        saved = rank_saved_bytes(n, rank.params, rank.tp)
    return NodeCost(n.name, forward_s=base.forward_s * t, backward_s=base.backward_s * t,
                    flops=int(base.flops * f), param_bytes=int(base.param_bytes * f),
                    activation_bytes=int(base.activation_bytes * f) if saved is None else saved,
                    output_bytes=value_bytes(n),
                    weight_fraction=base.weight_fraction)


_KINDS = (*PAIRS, "vocab_shard", "first_rank")


def _kind(node: torch.fx.Node, collectives: Any) -> str | None:
    if node.op != "call_function":
        return None
    return next((k for k in _KINDS if node.target is getattr(collectives, k)), None)


def _collective_cost(node: torch.fx.Node, kind: str, tp: int, hardware: Hardware) -> NodeCost:
    """Forward and backward seconds of one inserted tp.* call (whole-tensor bytes: the
    output of the calls that make a value whole, the input of those that shard one)."""
    source = node.all_input_nodes[0] if node.all_input_nodes else node
    whole = value_bytes(node) if kind in ("all_reduce", "copy", "all_gather") else value_bytes(source)
    forward, backward = call_s(kind, whole, needs_grad(source), tp, hardware)
    return NodeCost(node.name, forward_s=forward, backward_s=backward, output_bytes=value_bytes(node))


def _count(gm: torch.fx.GraphModule, collectives: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for n in gm.graph.nodes:
        kind = _kind(n, collectives)
        if kind is not None and kind not in ("vocab_shard", "first_rank"):
            counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(counts.items()))
