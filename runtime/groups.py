"""The process groups of a pipeline run: see [Note: process groups] in comm.py; the rank
layout is `manifest.Mesh` ([Note: rank layout]), re-exported here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from .manifest import Manifest, Mesh
from .schedule import StageGraph

__all__ = ["Mesh", "Groups", "make_groups"]


@dataclass
class Groups:
    """The groups this rank belongs to."""

    edges: dict[tuple[int, int], Any] = field(default_factory=dict)  # (producer, consumer) stage -> group
    dp: Any = None  # this (position, t)'s data-parallel group (None when dp == 1)
    dp_ranks: list[int] = field(default_factory=list)
    ties: dict[str, tuple[Any, list[int]]] = field(default_factory=dict)  # source name -> (group, ranks)
    tp: Any = None  # this (replica, position)'s tensor-parallel group (None when tp == 1)
    tp_ranks: list[int] = field(default_factory=list)
    world: Any = None  # every rank: the pipeline's own collectives (loss, clipping, step checks), never the default group


def make_groups(manifest: Manifest, graph: StageGraph, rank: int) -> Groups:
    """Create every group on every rank, in the same order (dist.new_group is collective),
    and keep the ones `rank` is in."""
    mesh = manifest.mesh
    replica, position, t = mesh.coords(rank)
    out = Groups(dp_ranks=[mesh.rank(r, position, t) for r in range(mesh.dp)],
                 tp_ranks=[mesh.rank(replica, position, u) for u in range(mesh.tp)])
    # 1. stage edges across positions, per replica and tensor-parallel index
    for r in range(mesh.dp):
        for u in range(mesh.tp):
            for p, c in graph.edges:
                if graph.rank_of(p) != graph.rank_of(c):
                    group = dist.new_group(sorted({mesh.rank(r, graph.rank_of(p), u), mesh.rank(r, graph.rank_of(c), u)}))
                    if (r, u) == (replica, t):
                        out.edges[(p, c)] = group
    # 2. data parallel, per position and tensor-parallel index
    if mesh.dp > 1:
        for pos in range(mesh.pp):
            for u in range(mesh.tp):
                group = dist.new_group([mesh.rank(r, pos, u) for r in range(mesh.dp)])
                if (pos, u) == (position, t):
                    out.dp = group
    # 3. tied parameters held on several positions: every holder, every replica, per t
    holders: dict[str, set[int]] = {}
    for stage in manifest.stages:
        for spec in stage.parameters:
            holders.setdefault(spec.source_name, set()).add(graph.rank_of(stage.index))
    for name in sorted(n for n, positions in holders.items() if len(positions) > 1):
        for u in range(mesh.tp):
            ranks = sorted(mesh.rank(r, pos, u) for pos in holders[name] for r in range(mesh.dp))
            group = dist.new_group(ranks)
            if rank in ranks:
                out.ties[name] = (group, ranks)
    # 4. tensor parallel, per replica and position (none when tp == 1)
    if mesh.tp > 1:
        for r in range(mesh.dp):
            for pos in range(mesh.pp):
                group = dist.new_group([mesh.rank(r, pos, u) for u in range(mesh.tp)])
                if (r, pos) == (replica, position):
                    out.tp = group
    # 5. the whole world, the pipeline's own (a user's collective on the default group never meets it)
    out.world = dist.new_group(list(range(mesh.world)))
    return out
