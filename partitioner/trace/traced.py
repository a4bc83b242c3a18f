"""A traced model (`Traced`): its graph, which tracer made it, and how the user's inputs
and outputs map onto it; what every tracer returns and the rest of the compiler reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.fx._lazy_graph_module import _LazyGraphModule

from .inputs import InputKey, flat_inputs

__all__ = ["Traced", "by_input_key", "copy_traced", "graph_module"]


@dataclass
class Traced:
    """A traced model: its graph, which tracer made it, and how inputs/outputs map."""

    gm: torch.fx.GraphModule
    tracer: str
    #: for each placeholder, in graph order: its name and the user's key
    #: (an int for a positional argument, a str for a keyword argument)
    input_keys: list[tuple[str, InputKey]]
    #: the structure of the model's output over `output_leaves`
    out_spec: pytree.TreeSpec
    output_leaves: list[Any]
    #: the `enabled` flag of each torch.autocast region the model enters in forward(),
    #: which the graph does not keep (`check_autocast`)
    autocast: tuple[bool, ...] = ()
    #: submodules kept whole (partitioner.trace.kept): dotted path -> the line that broke tracing
    kept: dict[str, str] = field(default_factory=dict)
    #: the regions the model runs under torch.utils.checkpoint, by module path, traced as
    #: the ops they run ([Note: the user's checkpointing])
    checkpointed: tuple[str, ...] = ()


def copy_traced(traced: Traced) -> Traced:
    """A copy of `traced` with its own graph (the model's tensors shared), to specialise
    without touching the original.  An fx graph reads sizes when it runs (`x.size(0)` is
    a node), so one fx trace serves every microbatch shape."""
    graph = torch.fx.Graph()
    mapping: dict[torch.fx.Node, torch.fx.Node] = {}
    out = next(n for n in traced.gm.graph.nodes if n.op == "output")
    graph.output(graph.graph_copy(traced.gm.graph, mapping), type_expr=out.type)
    gm = graph_module(traced.gm, graph)
    leaves = [mapping.get(leaf, leaf) if isinstance(leaf, torch.fx.Node) else leaf for leaf in traced.output_leaves]
    return Traced(gm, traced.tracer, list(traced.input_keys), traced.out_spec, leaves, traced.autocast,
                  dict(traced.kept), traced.checkpointed)


def graph_module(root: torch.nn.Module, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """`torch.fx.GraphModule(root, graph)`, compiled into Python only once it is called or
    its code read (fx's own `_LazyGraphModule`, whose `recompile` marks the code stale).
    The compiler mostly walks graphs, and compiling one of Megatron-LM's 529.6B model
    (4951 nodes) takes a quarter of a second, which a search did some twenty times."""
    return _LazyGraphModule(root, graph)


def by_input_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[InputKey, Any]:
    """The example batch keyed as `Traced.input_keys` names it: position, keyword, or a
    path into a nested one ([Note: input leaves] in inputs.py)."""
    return flat_inputs(args, kwargs)
