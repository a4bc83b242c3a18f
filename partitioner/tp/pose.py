"""Pose the tensor-parallel problem of a traced graph: strategies and their costs.

Variables, in graph order: each placeholder (replicated: every rank reads the whole batch),
each parameter (one variable per parameter, however many get_attr nodes read it, so tied
copies agree), each compute node, and the output (which must be replicated: the loss is
computed on the whole output).  Costs come from the node costs (compute / tp when split)
and the alpha-beta model of the tensor-parallel link (collectives: ring algorithms).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from ..cost.hardware import Hardware
from ..cost.waves import shard_factor
from ..ir import REPLICATED, Layout, NodeCost
from ..cost.roofline import ring_allreduce_s
from . import layers, shapes  # noqa: F401  (registers the built-in rules)
from .problem import CopyCost, EdgeCost, ShardingProblem
from .rules import SplitContext, Strategy, replicate, rule_for

__all__ = ["Posed", "pose_sharding", "call_s", "collective_s", "conversion", "needs_grad", "tp_link", "value_bytes"]

#: seconds per byte of parameter left whole: a tie-break towards sharding weights (memory)
_MEMORY_TIE_S_PER_BYTE = 1e-15
#: a partial sum only where it is strictly cheaper: on a tie the plain row split, which
#: reduces at once, reads simpler
_PARTIAL_TIE_S = 1e-12


@dataclass
class Posed:
    """The problem and what its variables and strategies stand for."""

    problem: ShardingProblem
    variables: list[str]  # the value of each variable: a node name or a parameter target
    strategies: list[list[Strategy]]
    node_var: dict[str, int] = field(default_factory=dict)  # fx node name -> variable


def tp_link(hardware: Hardware, tp: int = 1) -> tuple[float, float]:
    """(alpha s, beta s/byte) of one ring step between tensor-parallel ranks; the
    inter-node link when `tp` ranks outgrow a node of the profile."""
    return hardware.ring_link(across_nodes=tp > hardware.devices_per_node > 1)


def collective_s(kind: str, nbytes: float, tp: int, hardware: Hardware) -> float:
    """Seconds of one collective over `tp` ranks; `nbytes` is the whole tensor's size
    (all_gather and reduce_scatter: (p-1) steps of n/p; all_reduce: 2(p-1) steps of n/p,
    Patarasuk & Yuan 2009)."""
    if tp <= 1 or nbytes <= 0:
        return 0.0
    alpha, beta = tp_link(hardware, tp)
    if kind == "all_reduce":
        return ring_allreduce_s(nbytes, tp, alpha, beta)
    if kind in ("all_gather", "reduce_scatter"):
        return (tp - 1) * alpha + (tp - 1) / tp * nbytes * beta
    if kind == "scatter":
        return 0.0
    raise ValueError(kind)


#: the collective each runtime.tp function runs forward, and the one its backward runs
#: (the Megatron pairs, runtime/tp.py); the others (vocab_shard, first_rank) run none
PAIRS: dict[str, tuple[str | None, str | None]] = {
    "all_reduce": ("all_reduce", None),
    "copy": (None, "all_reduce"),
    "all_gather": ("all_gather", None),
    "scatter": (None, "all_gather"),
    "reduce_scatter": ("reduce_scatter", "all_gather"),
}


def call_s(function: str, nbytes: float, grad: bool, tp: int, hardware: Hardware) -> tuple[float, float]:
    """(forward, backward) seconds of one call of `tp.<function>` on a value of `nbytes`
    whole bytes; the backward's collective runs only when a gradient flows."""
    forward, backward = PAIRS.get(function, (None, None))
    return (collective_s(forward, nbytes, tp, hardware) if forward else 0.0,
            collective_s(backward, nbytes, tp, hardware) if backward and grad else 0.0)


def conversion(have: Layout, want: Layout) -> tuple[str, ...] | None:
    """The tp.* calls that turn layout `have` into `want` (None: no conversion exists)."""
    if have == want:
        return ()
    if want.partial:
        return None  # a partial sum is made by a node, not by a conversion
    if have.partial:
        return ("all_reduce",) if want.replicated else ("reduce_scatter",)
    if have.replicated:
        return ("scatter",)
    return ("all_gather",) if want.replicated else ("all_gather", "scatter")


def value_bytes(node: torch.fx.Node) -> int:
    meta = node.meta.get("tensor_meta")
    shape = getattr(meta, "shape", None)
    if meta is None or shape is None:
        return 0
    return math.prod(int(d) for d in shape) * meta.dtype.itemsize


def needs_grad(node: torch.fx.Node) -> bool:
    meta = node.meta.get("tensor_meta")
    return bool(getattr(meta, "requires_grad", False)) and bool(getattr(meta, "dtype", torch.int64).is_floating_point)


def pose_sharding(gm: torch.fx.GraphModule, costs: dict[str, NodeCost], tp: int, hardware: Hardware) -> Posed:
    """The tensor-parallel problem of `gm` for degree `tp`."""
    nodes = list(gm.graph.nodes)
    blocks = _block_counts(nodes)
    variables: list[str] = []
    strategies: list[list[Strategy]] = []
    node_var: dict[str, int] = {}
    made: dict[torch.fx.Node, set[Layout]] = {}
    # 1. placeholders and compute nodes; parameters wait for their readers' requests
    for n in nodes:
        if n.op == "get_attr":
            continue
        if n.op == "output":
            found = [Strategy("output", REPLICATED, tuple(REPLICATED for _ in n.all_input_nodes), sharded=False)]
        elif n.op == "placeholder":
            found = [Strategy("input", REPLICATED, (), sharded=False)]
        else:
            ctx = SplitContext(n, tp, blocks)
            rule = rule_for(n)
            found = [replicate(ctx)] + [s for s in (rule(ctx) if rule else []) if _reachable(s, n, made)]
        made[n] = {s.output for s in found}
        node_var[n.name] = len(variables)
        variables.append(n.name)
        strategies.append(found)
    # 2. one variable per parameter: replicated, or any layout a reader asks for
    weights = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    params: dict[str, set[Layout]] = {}
    for n in nodes:
        for s in strategies[node_var[n.name]] if n.name in node_var else []:
            for a, layout in zip(n.all_input_nodes, s.inputs):
                if a.op == "get_attr":  # buffers and constants stay whole
                    asked = params.setdefault(str(a.target), {REPLICATED})
                    if str(a.target) in weights:
                        asked.add(layout)
    param_var: dict[str, int] = {}
    for target, layouts in params.items():
        param_var[target] = len(variables)
        variables.append(target)
        strategies.append([Strategy("param", lay, (), sharded=not lay.replicated) for lay in sorted(layouts, key=_order)])
    problem = _costs(nodes, costs, tp, hardware, variables, strategies, node_var, param_var)
    return Posed(problem, variables, strategies, node_var)


def _order(layout: Layout) -> tuple[int, int, int]:
    return (0, 0, 0) if layout.replicated else (2 if layout.partial else 1, layout.dim or 0, layout.blocks)


def _reachable(s: Strategy, node: torch.fx.Node, made: dict[torch.fx.Node, set[Layout]]) -> bool:
    """Keep a split only if a producer can hand over one of the shards it reads as is
    (or every shard it reads is a parameter's, which takes any layout)."""
    wanted = [(a, lay) for a, lay in zip(node.all_input_nodes, s.inputs) if not lay.replicated and a.op != "get_attr"]
    return not wanted or any(lay in made.get(a, set()) for a, lay in wanted)


def _block_counts(nodes: list[torch.fx.Node]) -> tuple[int, ...]:
    """1, and every count of equal pieces a split makes (fused q/k/v: 3)."""
    counts = {1}
    for n in nodes:
        pieces = [u for u in n.users if u.op == "call_function" and u.target is operator.getitem]
        if pieces and n.meta.get("tensor_meta") is None and 1 < len(pieces) <= 8:
            shapes = {tuple(p.meta["tensor_meta"].shape) for p in pieces if p.meta.get("tensor_meta") is not None}
            if len(shapes) == 1:
                counts.add(len(pieces))
    return tuple(sorted(counts))


def _costs(nodes: list[torch.fx.Node], costs: dict[str, NodeCost], tp: int, hardware: Hardware,
           variables: list[str], strategies: list[list[Strategy]], node_var: dict[str, int],
           param_var: dict[str, int]) -> ShardingProblem:
    by_name = {n.name: n for n in nodes}
    cost_s: list[tuple[float, ...]] = []
    for name, found in zip(variables, strategies):
        node = by_name.get(name) if name in node_var else None
        cost_s.append(tuple(_strategy_s(node, s, costs, tp, hardware, name) for s in found))
    edges, copies = [], []
    for n in nodes:
        if n.name not in node_var:
            continue
        v = node_var[n.name]
        readers: dict[int, list[tuple[int, int]]] = {}
        for p, a in enumerate(n.all_input_nodes):
            u = param_var[str(a.target)] if a.op == "get_attr" else node_var[a.name]
            matrix = tuple(tuple(_convert_s(a, src.output, dst.inputs[p], tp, hardware) for dst in strategies[v])
                           for src in strategies[u])
            if any(c for row in matrix for c in row):
                edges.append(EdgeCost(u, v, matrix))
            if needs_grad(a):
                readers.setdefault(u, []).extend((v, j) for j, s in enumerate(strategies[v]) if p in s.partial_inputs())
        for u, pairs in readers.items():
            if pairs:
                node = by_name.get(variables[u])
                nbytes = value_bytes(node) if node is not None else _param_bytes(nodes, variables[u])
                copies.append(CopyCost(u, call_s("copy", nbytes, True, tp, hardware)[1], tuple(pairs)))
    return ShardingProblem(tuple(variables), tuple(cost_s), tuple(edges), tuple(_merge(copies)))


def _merge(copies: list[CopyCost]) -> list[CopyCost]:
    """One copy per value, whichever readers ask for it."""
    out: dict[int, CopyCost] = {}
    for c in copies:
        had = out.get(c.value)
        out[c.value] = c if had is None else CopyCost(c.value, c.cost_s, had.readers + c.readers)
    return [out[k] for k in sorted(out)]


def _param_bytes(nodes: list[torch.fx.Node], target: str) -> int:
    return next((value_bytes(n) for n in nodes if n.op == "get_attr" and str(n.target) == target), 0)


def _strategy_s(node: torch.fx.Node | None, s: Strategy, costs: dict[str, NodeCost], tp: int, hardware: Hardware,
                name: str) -> float:
    if s.rule == "param":
        return 0.0
    if node is None or name not in costs:
        return 0.0
    cost = costs[name]
    seconds = cost.time_s / tp if s.sharded else cost.time_s
    whole = getattr(node.meta.get("tensor_meta"), "shape", None)
    if s.sharded and cost.flops and whole is not None:  # the shard's own waves ([Note: waves of tiles])
        weighted = any(a.op == "get_attr" for a in node.all_input_nodes)
        seconds *= shard_factor(tuple(whole), s.output.local_shape(tuple(whole), tp), weighted, hardware)
    if s.reduce:
        seconds += call_s("all_reduce", value_bytes(node), needs_grad(node), tp, hardware)[0]
    if s.output.partial:
        seconds += _PARTIAL_TIE_S
    return seconds + _MEMORY_TIE_S_PER_BYTE * cost.param_bytes / (tp if s.sharded else 1)


def _convert_s(value: torch.fx.Node, have: Layout, want: Layout, tp: int, hardware: Hardware) -> float:
    """Seconds to turn `value` from layout `have` into `want` (forward and backward)."""
    calls = conversion(have, want)
    if calls == ():
        return 0.0
    if calls is None or value.op == "get_attr" or value.meta.get("tensor_meta") is None:
        return math.inf  # parameters take one layout; tuples cannot be converted
    nbytes, grad = value_bytes(value), needs_grad(value)
    return sum(sum(call_s(f, nbytes, grad, tp, hardware)) for f in calls)
