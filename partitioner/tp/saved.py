"""What one tensor-parallel rank's node keeps for backward ([Note: saved bytes on a tp rank]).

[Note: saved bytes on a tp rank]
    A node split across the tp ranks keeps, on each rank, what its local call saves: a shard
    of what it saves whole where everything it reads and makes is sharded (1/tp of the
    node's `activation_bytes`: the shards of a sequence-parallel region after a
    reduce_scatter, a head-split attention), but the WHOLE of a replicated input it reads
    (a column-split linear keeps its whole input X: its weight gradient dY^T X reads every
    row and column of it).  So a split node that reads a replicated activation is run again
    on the meta device with the rank's shapes, under `saved_tensors_hooks`, as
    cost/profile.py counts a whole node; the memory model (partitioner/predict/memory_terms.py)
    sums these per stage.
"""

from __future__ import annotations

from typing import Any, Hashable

import torch
import torch.fx

from ..cost.nodes import storage_key
from ..cost.profile import _bind, _flops_and_saved
from ..ir import Layout

__all__ = ["reads_whole_activation", "rank_saved_bytes"]

#: counts by call signature: the identical layers of a model, and the candidates of a search,
#: run each distinct call once
_COUNTED: dict[Hashable, int | None] = {}


def reads_whole_activation(n: torch.fx.Node, inputs: tuple[Layout, ...]) -> bool:
    """Whether `n`, split, reads a replicated activation (one its split does not divide)."""
    return any(lay.replicated and a.op != "get_attr" for a, lay in zip(n.all_input_nodes, inputs))


def rank_saved_bytes(n: torch.fx.Node, params: dict[str, Layout], tp: int) -> int | None:
    """Bytes the rank's call of `n` saves for backward, its weights left out, counted on
    meta tensors of its inputs' local shapes; None where an input has no known shape or the
    call fails on the meta device."""
    shapes = []
    for a in n.all_input_nodes:
        meta = a.meta.get("tensor_meta")
        if meta is None or not hasattr(meta, "shape"):
            return None
        local = params[str(a.target)].local_shape(tuple(meta.shape), tp) if str(a.target) in params else meta.shape
        shapes.append((tuple(local), meta.dtype, bool(meta.requires_grad), a.op == "get_attr"))
    key = (n.target, tuple(shapes), repr(torch.fx.node.map_arg((n.args, n.kwargs), lambda a: None)))
    if key not in _COUNTED:
        _COUNTED[key] = _count(n, shapes)
    return _COUNTED[key]


def _count(n: torch.fx.Node, shapes: list[tuple[tuple[int, ...], torch.dtype, bool, bool]]) -> int | None:
    """`rank_saved_bytes` of `n` run on meta tensors of `shapes` (shape, dtype, grad, weight)."""
    values: dict[torch.fx.Node, Any] = {}
    weights: set[int] = set()
    for a, (shape, dtype, grad, weight) in zip(n.all_input_nodes, shapes):
        t = torch.empty(shape, dtype=dtype, device="meta")
        values[a] = t.requires_grad_(grad and t.is_floating_point())
        if weight:
            weights.add(storage_key(t))
    try:
        fn, args, kwargs = _bind(n, values)
        return _flops_and_saved(fn, args, kwargs, weights)[1]
    except Exception:  # an op the meta device cannot run: the share of the whole's count
        return None
