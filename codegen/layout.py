"""Cut the graph into stages: which values each stage reads, owns, and passes on.

See [Note: stage boundaries] in partitioner/ir.py: data flows forward only, a value is
sent directly from its producer's stage to every later stage that reads it, model inputs
are read by each stage from the batch, and the output node lies in the last stage.
Parameters and buffers are owned by every stage that reads them (a tied parameter read in
two stages is held twice and kept in sync by the runtime).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx

__all__ = ["StageLayout", "lay_out"]


@dataclass
class StageLayout:
    """The boundary of one stage, in graph order."""

    index: int
    nodes: list[torch.fx.Node] = field(default_factory=list)  # compute nodes, graph order
    inputs: list[torch.fx.Node] = field(default_factory=list)  # placeholders and earlier stages' nodes
    outputs: list[torch.fx.Node] = field(default_factory=list)  # values later stages read
    attrs: list[torch.fx.Node] = field(default_factory=list)  # get_attr nodes it reads
    consumers: dict[torch.fx.Node, list[int]] = field(default_factory=dict)  # output -> stages


def lay_out(graph: torch.fx.Graph, stage_of: dict[str, int], num_stages: int) -> list[StageLayout]:
    """One `StageLayout` per stage for an assignment of compute nodes to stages."""
    layouts = [StageLayout(k) for k in range(num_stages)]
    order = {n: i for i, n in enumerate(graph.nodes)}

    def stage(n: torch.fx.Node) -> int:
        return num_stages - 1 if n.op == "output" else stage_of[n.name]

    for node in graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            layouts[stage(node)].nodes.append(node)
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module", "output"):
            continue
        here = layouts[stage(node)]
        for src in node.all_input_nodes:
            if src.op == "get_attr":
                _add(here.attrs, src)
            elif src.op == "placeholder" or stage(src) != here.index:
                if src.op != "placeholder" and stage(src) > here.index:
                    raise ValueError(f"{src.name} (stage {stage(src)}) flows back to stage {here.index}")
                _add(here.inputs, src)
                if src.op != "placeholder":
                    owner = layouts[stage(src)]
                    _add(owner.outputs, src)
                    readers = owner.consumers.setdefault(src, [])
                    if here.index not in readers:
                        readers.append(here.index)
    for layout in layouts:
        layout.inputs.sort(key=order.__getitem__)
        layout.outputs.sort(key=order.__getitem__)
        layout.attrs.sort(key=order.__getitem__)
        for readers in layout.consumers.values():
            readers.sort()
    return layouts


def _add(items: list[torch.fx.Node], node: torch.fx.Node) -> None:
    if node not in items:
        items.append(node)
