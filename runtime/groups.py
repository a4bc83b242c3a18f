"""The process groups of a pipeline run: see [Note: process groups] in comm.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from .schedule import StageGraph

__all__ = ["Groups", "make_groups"]


@dataclass
class Groups:
    """The groups this rank belongs to."""

    edges: dict[tuple[int, int], Any] = field(default_factory=dict)  # (producer, consumer) stage -> group
    dp: Any = None  # this position's data-parallel group (None when dp == 1)
    dp_ranks: list[int] = field(default_factory=list)
    ties: dict[str, tuple[Any, list[int]]] = field(default_factory=dict)  # source name -> (group, ranks)


def make_groups(manifest: dict[str, Any], graph: StageGraph, rank: int) -> Groups:
    """Create every group on every rank, in the same order (dist.new_group is collective),
    and keep the ones `rank` is in."""
    pp, dp = graph.num_ranks, int(manifest["mesh"]["dp"])
    position, replica = rank % pp, rank // pp
    out = Groups(dp_ranks=[r * pp + position for r in range(dp)])
    # 1. stage edges across ranks, per replica
    for r in range(dp):
        for p, c in graph.edges:
            if graph.rank_of(p) != graph.rank_of(c):
                group = dist.new_group(sorted({r * pp + graph.rank_of(p), r * pp + graph.rank_of(c)}))
                if r == replica:
                    out.edges[(p, c)] = group
    # 2. data parallel, per position
    if dp > 1:
        for pos in range(pp):
            group = dist.new_group([r * pp + pos for r in range(dp)])
            if pos == position:
                out.dp = group
    # 3. tied parameters held on several positions: every holder, every replica
    holders: dict[str, set[int]] = {}
    for stage in manifest["stages"]:
        for spec in stage["parameters"]:
            holders.setdefault(spec["source_name"], set()).add(graph.rank_of(stage["index"]))
    for name in sorted(n for n, positions in holders.items() if len(positions) > 1):
        ranks = sorted(r * pp + pos for pos in holders[name] for r in range(dp))
        group = dist.new_group(ranks)
        if rank in ranks:
            out.ties[name] = (group, ranks)
    return out
