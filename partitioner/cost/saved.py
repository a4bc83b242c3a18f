"""What each pipeline stage keeps for backward per microbatch, counted once per storage.

[Note: saved bytes per stage]
    A node's `activation_bytes` counts what autograd saves running that node alone, by
    the size of each saved view; summed over a stage it misses that the stage keeps
    the whole storage a view lies in (`q`, `k` and `v`, views of one qkv projection,
    keep all of it) and counts twice what two nodes save.  `stage_saved_bytes` runs each
    node of the stage again on its values under `saved_tensors_hooks` and keeps a set of
    storages per stage: a saved tensor that is a node's value (an input, or the node's
    own output) stands for the storage of the node that made it (views followed back
    through `node.meta["aliases"]`), at that storage's full size (a microbatch of the
    batch is a view of the whole), except a value that another stage made, which
    arrives in a buffer of its own size;
    anything else the op saves (a softmax's statistics) is its own.  Parameters are left out.  Attention on
    the meta device counts what a fused kernel saves, as `annotate` does.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.fx

from .nodes import compute_nodes, storage_key, tensors
from .profile import _bind, _flash_saved

__all__ = ["stage_saved_bytes"]


#: a saved tensor of one node: (its maker's name or None, the maker's base's name, the
#: storage key where no node made it, the storage's bytes, the value's own bytes, whether
#: the maker is a placeholder)
Entry = tuple[str | None, str | None, int, int, int, bool]
#: per graph: (id of the values it was run on, what each node saves); names and numbers only
_CACHE: "weakref.WeakKeyDictionary[torch.fx.GraphModule, tuple[int, dict[str, list[Entry]]]]" = (
    weakref.WeakKeyDictionary())


def stage_saved_bytes(gm: torch.fx.GraphModule, values: dict[torch.fx.Node, Any], stage_of: dict[str, int],
                      stages: int) -> list[int]:
    """Bytes each stage keeps for backward per microbatch ([Note: saved bytes per stage])."""
    kept: list[dict[Any, int]] = [{} for _ in range(stages)]
    for name, entries in _per_node(gm, values).items():
        if name in stage_of:
            k = stage_of[name]
            for maker, base, key, full, own, batch in entries:
                if maker is None:
                    kept[k][("own", name, key)] = full
                elif not batch and stage_of.get(maker, -1) != k:  # received: a buffer of its own
                    kept[k][("input", maker)] = own
                else:
                    kept[k][("value", base)] = max(full, kept[k].get(("value", base), 0))
    return [sum(k.values()) for k in kept]


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
