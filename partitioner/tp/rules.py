"""The registry of split rules: how one graph node may be computed across a tensor-parallel group.

A rule is a function from a `SplitContext` (the node, its inputs' shapes, the degree)
to the `Strategy`s that node admits.  Every node also admits `replicate` (all inputs whole,
the whole op on every rank), so a rule only lists the ways to split.  Rules are looked up
by the node's call target: a function or an aten op (`F.linear`, `torch.ops.aten.addmm`),
or a method name for `x.view(...)`.  Users add their own with one decorator:

    from partitioner.tp import Layout, split_rule

    @split_rule(my_ops.fused_gelu)                 # a function the model calls (fx.wrap'ed)
    def _fused_gelu(ctx):
        x, = ctx.inputs
        return [ctx.strategy("fused_gelu.last", Layout(ctx.ndim() - 1), {x: Layout(ctx.ndim(x) - 1)})]

[Note: layouts and gradients]
    A strategy names the layout it needs of each input and the layout of its output.
    Values are replicated (R) or sharded (S{d}); there is no partial-sum value between
    nodes: a rule whose output is a partial sum (a row-split linear) reduces it itself
    (`reduce`), so the all_reduce is part of the rule and its cost.  The gradient of an R
    value is whole on every rank; the gradient of an S value is the rank's shard.  When a
    node with a sharded output reads an R input, each rank computes only part of that
    input's gradient, so the rewrite passes such inputs through `tp.copy` (identity
    forward, all_reduce backward: Megatron's f), once per value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.fx

from ..ir import REPLICATED, Layout

__all__ = ["Strategy", "SplitContext", "RuleFn", "split_rule", "rule_for", "replicate", "insert"]

#: a rewrite hook: (node, its strategy, tp degree) -> None, editing the node's graph in place
Rewrite = Callable[[torch.fx.Node, "Strategy", int], None]


@dataclass(frozen=True)
class Strategy:
    """One way to compute a node across a tensor-parallel group.

    `inputs` holds a layout per `node.all_input_nodes` entry, in that order.  `sharded`:
    each rank does 1/tp of the node's work.  `reduce`: the rule ends in an all_reduce of its
    output (see `rewrite`).  `partial`: indexes of R inputs whose gradient each rank only
    computes in part; None means every R input when the output is sharded (see [Note:
    layouts and gradients]).  `rewrite` writes the node for one rank (local shape arguments,
    inserted collectives); None leaves the call as it is.
    """

    rule: str
    output: Layout
    inputs: tuple[Layout, ...]
    sharded: bool = True
    reduce: bool = False
    partial: frozenset[int] | None = None
    rewrite: Rewrite | None = field(default=None, compare=False)

    def partial_inputs(self) -> frozenset[int]:
        if self.partial is not None:
            return self.partial
        if self.output.replicated:
            return frozenset()
        return frozenset(i for i, layout in enumerate(self.inputs) if layout.replicated)


@dataclass
class SplitContext:
    """What a rule sees of one node: its inputs, their shapes, and the degree."""

    node: torch.fx.Node
    tp: int
    blocks: tuple[int, ...] = (1,)  # block counts worth trying for fused projections

    @property
    def inputs(self) -> list[torch.fx.Node]:
        return list(self.node.all_input_nodes)

    def shape(self, node: torch.fx.Node | None = None) -> tuple[int, ...] | None:
        """The global shape of `node`'s value (this node's by default); None if not a tensor."""
        meta = (node or self.node).meta.get("tensor_meta")
        shape = getattr(meta, "shape", None)
        return tuple(int(d) for d in shape) if shape is not None else None

    def ndim(self, node: torch.fx.Node | None = None) -> int:
        shape = self.shape(node)
        return len(shape) if shape is not None else 0

    def arg(self, index: int, name: str | None = None, default: Any = None) -> Any:
        """Positional argument `index`, else keyword `name`, else `default`."""
        if index < len(self.node.args):
            return self.node.args[index]
        return self.node.kwargs.get(name, default) if name else default

    def is_param(self, value: Any) -> bool:
        return isinstance(value, torch.fx.Node) and value.op == "get_attr"

    def divides(self, size: int, blocks: int = 1) -> bool:
        return size % (self.tp * blocks) == 0 and size >= self.tp * blocks

    def strategy(self, rule: str, output: Layout, layouts: dict[torch.fx.Node, Layout] | None = None,
                 **kwargs: Any) -> Strategy:
        """A strategy with `layouts` for the named inputs and R for the others."""
        given = layouts or {}
        return Strategy(rule, output, tuple(given.get(n, REPLICATED) for n in self.inputs), **kwargs)


RuleFn = Callable[[SplitContext], list[Strategy]]
_RULES: dict[Any, RuleFn] = {}


def split_rule(*targets: Any) -> Callable[[RuleFn], RuleFn]:
    """Register a rule for call targets: functions, aten ops or packets, or method names."""

    def register(fn: RuleFn) -> RuleFn:
        for target in targets:
            _RULES[target] = fn
        return fn

    return register


def rule_for(node: torch.fx.Node) -> RuleFn | None:
    """The registered rule for `node`, by its target (an aten overload falls back to its
    packet, then to the pointwise rule when aten tags it pointwise)."""
    target = node.target
    if node.op == "call_method":
        return _RULES.get(target)
    if node.op != "call_function":
        return None
    if target in _RULES:
        return _RULES[target]
    packet = getattr(target, "overloadpacket", None)
    if packet is not None and packet in _RULES:
        return _RULES[packet]
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        return _RULES.get("pointwise")
    return None


def replicate(ctx: SplitContext) -> Strategy:
    """Every input whole, the whole op on every rank: always valid."""
    return Strategy("replicate", REPLICATED, tuple(REPLICATED for _ in ctx.inputs), sharded=False)


def register_many(targets: Iterable[Any], fn: RuleFn) -> None:
    for target in targets:
        _RULES[target] = fn


def insert(before: torch.fx.Node, target: Any, args: tuple[Any, ...], name: str, meta: Any = None, *,
           op: str = "call_function", kwargs: dict[str, Any] | None = None,
           origin: tuple[str, float] | None = None) -> torch.fx.Node:
    """A new node right before `before`, named `name`, with tensor_meta `meta`.  `origin`
    (node name, share) gives it that share of the named node's compute cost (rewrite.py);
    without it, a collective is costed as one and anything else as free."""
    with before.graph.inserting_before(before):
        node = before.graph.create_node(op, target, args, kwargs or {}, name=name)
    if meta is not None:
        node.meta["tensor_meta"] = meta
    if origin is not None:
        node.meta["tp_origin"] = origin
    node.meta["nn_module_stack"] = before.meta.get("nn_module_stack", {})
    return node
