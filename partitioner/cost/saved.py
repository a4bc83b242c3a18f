"""What each pipeline stage keeps for backward per microbatch, counted once per storage.

[Note: saved bytes per stage]
    A node's `activation_bytes` counts what autograd saves running that node alone, by
    the size of each saved view; summed over a stage it misses that the stage keeps
    the whole storage a view lies in (`q`, `k` and `v`, views of one qkv projection,
    keep all of it) and counts twice what two nodes save.  `stage_saved_bytes` runs each
    node of the stage again on its values under `saved_tensors_hooks` and keeps a set of
    storages per stage: a saved tensor that is a node's value (an input, or the node's
    own output) stands for the storage of the node that made it (views followed back
    through `node.meta["aliases"]`), at that storage's full size, except a value that
    another stage made, which arrives in a buffer of its own size, and a microbatch of
    the batch, counted at its own size: on a GPU it is moved there, a tensor of its own;
    on the CPU it is a view of the caller's batch, which all the microbatches share, so
    that the microbatches in flight count what the batch holds (at most);
    anything else the op saves (a softmax's statistics) is its own.  Parameters are left out.  Attention on
    the meta device counts what a fused kernel saves, as `annotate` does.
    A value passed to a stage of the same rank travels in memory, not in a buffer of its
    own: the rank keeps the maker's storage from the maker's forward to its backward
    (the pipeline holds the stage's outputs until then), so the maker's stage counts it
    (`stage_passed_bytes`), and the stage that saves it does not.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx

from runtime.offload import MIN_BYTES

from .nodes import compute_nodes, storage_key, tensors
from .profile import _bind, _flash_saved

__all__ = ["Passed", "stage_offloadable", "stage_passed_bytes", "stage_saved_bytes"]


#: a saved tensor of one node: (its maker's name or None, the maker's base's name, the
#: storage key where no node made it, the storage's bytes, the value's own bytes, whether
#: the maker is a placeholder)
Entry = tuple[str | None, str | None, int, int, int, bool]
#: per graph: (id of the values it was run on, what each node saves); names and numbers only
_CACHE: "weakref.WeakKeyDictionary[torch.fx.GraphModule, tuple[int, dict[str, list[Entry]]]]" = (
    weakref.WeakKeyDictionary())


#: the pipeline rank of each stage
RankOf = Callable[[int], int]


def stage_saved_bytes(gm: torch.fx.GraphModule, values: dict[torch.fx.Node, Any], stage_of: dict[str, int],
                      stages: int, rank_of: RankOf | None = None) -> list[int]:
    """Bytes each stage keeps for backward per microbatch ([Note: saved bytes per stage]);
    with `rank_of`, a value from a stage of the same rank is left to its maker's."""
    return [sum(k.values()) for k in _kept(gm, values, stage_of, stages, rank_of)]


def stage_offloadable(gm: torch.fx.GraphModule, values: dict[torch.fx.Node, Any], stage_of: dict[str, int],
                      stages: int, rank_of: RankOf | None = None) -> list[list[int]]:
    """Per stage, the bytes of each saved storage that offloading may move, in the order
    the stage's forward saves them: not its inputs (received, or of the batch), nor any
    under `runtime.offload.MIN_BYTES` ([Note: activation offloading] in runtime/offload.py)."""
    batch = {n.name for n in gm.graph.nodes if n.op == "placeholder"}
    return [[n for key, n in k.items() if key[0] != "input" and not (key[0] == "value" and key[1] in batch)
             and n >= MIN_BYTES] for k in _kept(gm, values, stage_of, stages, rank_of)]


@dataclass(frozen=True)
class Passed:
    """Per microbatch, what a stage passes in memory to stages of its own rank
    ([Note: saved bytes per stage]): `storage`, the storages of those values that the
    stage does not save itself; `grads`, their gradients (one per value)."""

    storage: int = 0
    grads: int = 0


def stage_passed_bytes(gm: torch.fx.GraphModule, values: dict[torch.fx.Node, Any], stage_of: dict[str, int],
                       stages: int, rank_of: RankOf) -> tuple[list[Passed], list[int]]:
    """Per stage, what it passes to stages of its own rank, and the gradients of what it
    takes from them (made by its backward, kept until the maker's backward)."""
    kept = _kept(gm, values, stage_of, stages, rank_of)
    bases: list[dict[str, int]] = [{} for _ in range(stages)]
    grads, taken = [0] * stages, [0] * stages
    for node in compute_nodes(gm):
        k = stage_of.get(node.name, -1)
        local = {stage_of[u.name] for u in node.users if stage_of.get(u.name, k) != k and rank_of(stage_of[u.name]) == rank_of(k)}
        if k < 0 or not local:
            continue
        base = _base(node)
        if ("value", base.name) not in kept[k]:
            bases[k][base.name] = _bytes(values.get(base))
        own = sum(t.numel() * t.element_size() for t in tensors(values.get(node)) if t.is_floating_point())
        grads[k] += own * len(local)
        for c in local:
            taken[c] += own
    return [Passed(sum(b.values()), g) for b, g in zip(bases, grads)], taken


def _kept(gm: torch.fx.GraphModule, values: dict[torch.fx.Node, Any], stage_of: dict[str, int], stages: int,
          rank_of: RankOf | None) -> list[dict[Any, int]]:
    """Per stage, its saved storages by key ([Note: saved bytes per stage])."""
    kept: list[dict[Any, int]] = [{} for _ in range(stages)]
    for name, entries in _per_node(gm, values).items():
        if name in stage_of:
            k = stage_of[name]
            for maker, base, key, full, own, batch in entries:
                there = stage_of.get(maker, -1) if maker is not None else -1
                if maker is None:
                    kept[k][("own", name, key)] = full
                elif not batch and there != k and rank_of is not None and there >= 0 and rank_of(there) == rank_of(k):
                    continue  # passed in memory: its maker's stage counts it
                elif not batch and there != k:  # received: a buffer of its own
                    kept[k][("input", maker)] = own
                else:  # a microbatch of the batch: its own bytes (the Note)
                    kept[k][("value", base)] = max(own if batch else full, kept[k].get(("value", base), 0))
    return kept


def _per_node(gm: torch.fx.GraphModule, values: dict[torch.fx.Node, Any]) -> dict[str, list[Entry]]:
    """What each compute node saves, run once per graph and values (a search asks for many plans)."""
    cached = _CACHE.get(gm)
    if cached is not None and cached[0] == id(values):
        return cached[1]
    params = {storage_key(p) for p in gm.parameters()} | {storage_key(b) for b in gm.buffers()}
    table = {node.name: _saved(node, values, params) for node in compute_nodes(gm)}
    _CACHE[gm] = (id(values), table)
    return table


def _saved(node: torch.fx.Node, values: dict[torch.fx.Node, Any], params: set[int]) -> list[Entry]:
    """What `node` saves."""
    fn, args, kwargs = _bind(node, values)
    flash = _flash_saved(node, args, values.get(node))
    if flash is not None:
        return [(None, None, -1, flash, flash, False)]
    owner = {storage_key(t): x for x in node.all_input_nodes for t in tensors(values.get(x))}
    found: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        found[storage_key(t)] = t.untyped_storage().nbytes()
        return t.detach()  # not `t`: an op's own output would hold its node in a cycle

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args, **kwargs)
    mine = {storage_key(t) for t in tensors(out)}
    result: list[Entry] = []
    for key, nbytes in found.items():
        maker = owner.get(key) if key not in mine else node
        if key in params:
            continue
        if maker is None:
            result.append((None, None, key, nbytes, nbytes, False))
        else:
            base = _base(maker)
            own = sum(t.numel() * t.element_size() for t in tensors(values.get(maker)))
            result.append((maker.name, base.name, key, max(nbytes, _bytes(values.get(base))), own,
                           maker.op == "placeholder"))
    return result


def _base(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose storage `node`'s value lies in (views followed back)."""
    seen = {node}
    while node.meta.get("aliases"):
        parent = next((x for x in node.all_input_nodes if x.name in node.meta["aliases"]), None)
        if parent is None or parent in seen or parent.op == "get_attr":
            break
        node = parent
        seen.add(node)
    return node


def _bytes(value: Any) -> int:
    return max((t.untyped_storage().nbytes() for t in tensors(value)), default=0)
