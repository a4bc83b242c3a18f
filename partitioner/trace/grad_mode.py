"""The model's own `torch.no_grad()` regions, kept in the graph as `detach`es.

[Note: no_grad regions]
    A graph has no grad mode: fx runs a `with torch.no_grad():` at trace time and keeps
    nothing of it, and export's `wrap_with_set_grad_enabled` is inlined (passes.py).  Run
    with gradients on, an op of such a region records autograd history the original never
    did, and one that writes `out=` a buffer fails outright (spectral norm's power
    iteration: "functions with out=... arguments don't support automatic
    differentiation").  So each node made with grad mode off is marked
    (`mark_grad_mode`: fx's tracer marks the nodes it makes while the model's no_grad is
    entered; inlining marks an export region's nodes) and `keep_no_grad` detaches every
    tensor such a node reads from outside its region (a placeholder, a parameter, a node
    computed with gradients on; an item it takes of a tuple made outside, `pair[0]`, is
    Python's indexing, which no_grad leaves as it is, so that item counts as outside too).
    Inside the region nothing then requires grad, as under no_grad: its results carry no
    history, and its in-place and `out=` writes land in the same storage (a detached tensor
    shares it and its version counter), so the stages run the region as the original does,
    and the graph stays one that any split of it keeps.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

__all__ = ["NO_GRAD", "keep_no_grad", "mark_grad_mode"]

#: `node.meta` key: the node was made with grad mode off
NO_GRAD = "no_grad"

_CALLS = ("call_function", "call_method", "call_module")


def mark_grad_mode(node: torch.fx.Node, enabled: bool | None = None) -> None:
    """Mark a call node made with grad mode off (`enabled`, else torch's mode now)."""
    if node.op in _CALLS and not (torch.is_grad_enabled() if enabled is None else enabled):
        node.meta[NO_GRAD] = True


def keep_no_grad(gm: torch.fx.GraphModule, values: dict[torch.fx.Node, Any], aten: bool = False) -> int:
    """Detach each tensor (by `values`, a run of the graph) a no_grad node reads from outside
    its region ([Note: no_grad regions]), as `aten.detach` in an export graph (`aten`), else
    as fx's `.detach()`; the number of detaches added."""
    graph = gm.graph
    detached: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in list(graph.nodes):
        if not node.meta.get(NO_GRAD):
            continue
        if _picks_from_outside(node):  # a tensor of a tuple made with gradients is one of its own
            del node.meta[NO_GRAD]
            continue
        for source in node.all_input_nodes:
            if source.meta.get(NO_GRAD) or not isinstance(values.get(source), torch.Tensor):
                continue
            if source not in detached:
                with graph.inserting_before(node):
                    detached[source] = (graph.call_function(torch.ops.aten.detach.default, (source,)) if aten
                                        else graph.call_method("detach", (source,)))
                detached[source].meta.update({k: v for k, v in source.meta.items() if k in ("nn_module_stack", "stack_trace")})
                values[detached[source]] = values[source].detach()
            node.replace_input_with(source, detached[source])
    if detached:
        graph.lint()
        gm.recompile()
    return len(detached)


def _picks_from_outside(node: torch.fx.Node) -> bool:
    """Whether `node` takes an item or attribute of a value made outside its region (a
    tuple's `[0]`, `torch.max(...).values`): Python's indexing, which no_grad leaves as it
    is, so its result is outside the region too and detached where the region reads it."""
    picks = node.op == "call_function" and node.target in (operator.getitem, getattr)
    source = node.args[0] if node.args else None
    return picks and isinstance(source, torch.fx.Node) and not source.meta.get(NO_GRAD)
