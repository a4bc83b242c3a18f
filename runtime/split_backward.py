"""The weight-gradient half of a split backward, without walking the graph twice.

[Note: weight-gradient seeds]
    I runs `torch.autograd.grad` from the stage's roots to its input leaves.  The nodes
    it runs are those on a path to an input ("input nodes"); the parameters hang off
    them through edges that lead to no input (a matmul's weight edge, through a
    transpose).  `plan` finds those FRONTIER nodes before I and hooks them, so I records
    the gradient each one receives (complete: a node runs once all its gradients are
    summed).  W then runs, for each frontier node, `torch.autograd.backward` from that
    node (a GradientEdge) with those gradients and `inputs=` only the parameters below
    its non-input edges: the engine computes only those edges (one matmul per weight),
    accumulating into `.grad` as the fused backward does (hooks included).

    This is exact only when every path from the roots to a parameter leaves the input
    nodes through one frontier edge; a parameter below two of them (a weight used twice)
    would be counted twice.  `plan` returns None then, and when a root reaches no input,
    or a parameter is out of the input nodes' reach: W walks the whole graph again from
    the roots (`torch.autograd.backward(roots, inputs=weight_inputs(roots, params))`),
    exact in every case.

[Note: a weight-only group norm backward]
    torch's CPU group norm backward dies (SIGSEGV) when asked for the weight and bias
    gradients without the input's, on an input that is not contiguous (channels_last):
    `native_group_norm_backward` with output_mask [False, True, True].  W asks exactly
    that of a group norm at the frontier, and the whole-graph W of one whose input leads
    to no parameter.  So W's `inputs` also name such a node's edge toward its input
    (`weight_inputs`, `plan`; every input then as a GradientEdge): the engine computes
    the node's whole backward and stops at that edge.  The node beyond runs too, with
    nothing asked of it (a stage input's leaf gets a `.grad` nobody reads), but it may
    read what it saved: so such frontier nodes run first and keep the graph's buffers
    for the rest.  The profiler times W the same way (partitioner/cost/profile.py, `_time`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["Seeds", "plan", "unsafe_weight_only", "weight_inputs"]

#: what W names as `inputs`: the parameters, or where one of them needs its input's
#: gradient too ([Note: a weight-only group norm backward]) every one as an edge
Inputs = list[torch.Tensor] | list[GradientEdge]


@dataclass
class Seeds:
    """Frontier nodes, the parameters below each, and (after I) the gradients they got."""

    nodes: list[tuple[Node, Inputs]]
    grads: dict[int, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)
    handles: list[Any] = field(default_factory=list)

    def hook(self) -> None:
        for node, _ in self.nodes:
            self.handles.append(node.register_prehook(self._recorder(node)))

    def _recorder(self, node: Node) -> Any:
        def record(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            self.grads[id(node)] = tuple(grad_outputs)
        return record

    def unhook(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def complete(self) -> bool:
        """Whether I ran every frontier node (else W walks the whole graph)."""
        return all(id(node) in self.grads for node, _ in self.nodes)

    def run(self) -> None:
        """W: each frontier node's parameter gradients, accumulated into `.grad`."""
        for node, params in self.nodes:
            edges, grads = [], []
            for k, g in enumerate(self.grads.pop(id(node))):
                if g is not None:
                    edges.append(GradientEdge(node, k))
                    grads.append(g)
            if edges:  # edges as inputs lead toward the input too: the node beyond runs, keep what it saved
                torch.autograd.backward(edges, grads, inputs=params, retain_graph=isinstance(params[0], GradientEdge))


def plan(roots: list[torch.Tensor], leaves: list[torch.Tensor], params: list[torch.Tensor]) -> Seeds | None:
    """The frontier of the input nodes and the parameters below it ([Note: weight-gradient
    seeds]); None where W must walk the whole graph."""
    if not roots or not leaves:
        return None
    leaf_ids = {id(t) for t in leaves}
    param_of = {id(p): p for p in params}
    reaches: dict[Node, bool] = {}

    def to_input(node: Node | None) -> bool:
        """Whether `node` leads to an input leaf (iteratively: graphs are deep)."""
        if node is None:
            return False
        stack = [(node, False)]
        while stack:
            n, expanded = stack.pop()
            if n in reaches:
                continue
            kids = [c for c, _ in n.next_functions if c is not None]
            if expanded:
                var = getattr(n, "variable", None)
                reaches[n] = (var is not None and id(var) in leaf_ids) or any(reaches[c] for c in kids)
            else:
                stack.append((n, True))
                stack += [(c, False) for c in kids if c not in reaches]
        return reaches[node]

    if not all(to_input(r.grad_fn) for r in roots):
        return None
    seen_params: set[int] = set()
    nodes: list[tuple[Node, Inputs]] = []
    for node in [n for n, yes in reaches.items() if yes]:
        below: list[torch.Tensor] = []
        for child, _ in node.next_functions:
            if child is None or reaches[child]:
                continue
            for pid in _params_below(child, param_of):
                if pid in seen_params:
                    return None  # reached through two frontier edges: counted twice
                seen_params.add(pid)
                below.append(param_of[pid])
        if below and unsafe_weight_only(node):  # [Note: a weight-only group norm backward]: first
            toward_input = [GradientEdge(c, k) for c, k in node.next_functions if c is not None and reaches[c]]
            nodes.insert(0, (node, [*map(get_gradient_edge, below), *toward_input]))
        elif below:
            nodes.append((node, below))
    return Seeds(nodes)  # every path to a parameter leaves the input nodes by a frontier edge


def _params_below(node: Node, param_of: dict[int, torch.Tensor]) -> set[int]:
    found: set[int] = set()
    stack, seen = [node], {node}
    while stack:
        n = stack.pop()
        var = getattr(n, "variable", None)
        if var is not None and id(var) in param_of:
            found.add(id(var))
        for c, _ in n.next_functions:
            if c is not None and c not in seen:
                seen.add(c)
                stack.append(c)
    return found


def unsafe_weight_only(node: Node) -> bool:
    """Whether asking `node` for its weights' gradients without its input's may crash the
    process ([Note: a weight-only group norm backward]): a group norm on the CPU whose
    saved input is not contiguous, or is held by saved-tensor hooks (its layout unknown)."""
    if node.name() != "NativeGroupNormBackward0":
        return False
    metadata = node._input_metadata  # type: ignore[attr-defined]
    if not metadata or metadata[0].device.type != "cpu":
        return False
    try:
        saved = node._raw_saved_input.data  # type: ignore[attr-defined]  # (not unpacked: no hook runs)
    except RuntimeError:  # freed
        return False
    return not (isinstance(saved, torch.Tensor) and saved.is_contiguous())


def weight_inputs(roots: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> Inputs:
    """What a whole-graph W from `roots` names as its `inputs`: `params`, and with them,
    as edges, the edge toward the input of every node under them that may not be asked
    for its weights alone ([Note: a weight-only group norm backward]).  Only CPU graphs
    are walked."""
    if not any(r.device.type == "cpu" for r in roots):
        return list(params)
    toward_input: list[GradientEdge] = []
    stack = [r.grad_fn for r in roots if r.grad_fn is not None]
    seen = set(stack)
    while stack:
        node = stack.pop()
        first, k = node.next_functions[0] if node.next_functions else (None, 0)
        if first is not None and unsafe_weight_only(node):
            toward_input.append(GradientEdge(first, k))  # its input's (weight and bias follow)
        for c, _ in node.next_functions:
            if c is not None and c not in seen:
                seen.add(c)
                stack.append(c)
    return [*map(get_gradient_edge, params), *toward_input] if toward_input else list(params)
