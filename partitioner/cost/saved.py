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
    another rank's stage made, which arrives in a message the stage holds whole anyway
    ([Note: what the pipeline holds per microbatch]), and a microbatch of
    the batch, counted at its own size: on a GPU it is moved there, a tensor of its own;
    on the CPU it is a view of the caller's batch, which all the microbatches share, so
    that the microbatches in flight count what the batch holds (at most);
    anything else the op saves (a softmax's statistics) is its own.  Parameters are left out.  Attention on
    the meta device counts what a fused kernel saves, as `annotate` does.
    A value passed to a stage of the same rank travels in memory, not in a buffer of its
    own: the rank keeps the maker's storage from the maker's forward to its backward
    (the pipeline holds the stage's outputs until then), so the maker's stage counts it
    (`stage_passed_bytes`), and the stage that saves it does not.

[Note: what the pipeline holds per microbatch]
    Beside what autograd saves, a stage's runner keeps each microbatch's arguments and
    outputs from its forward to its backward (runtime/stage.py), whatever its nodes save:
    - every message it received, whole: the values of one message are views of its one
      buffer (runtime/messages.py), so keeping any keeps all of it;
    - the storage of every value it sends to another rank, except one that is its own
      message (the only value of its pair, contiguous, filling its storage): that buffer
      is the send itself, kept until the step waits on its sends (the walk's `sent`);
      another is copied into a packed message (or is a view), and its storage is kept
      beside the message.
    `_kept` counts these among the stage's storages (`stage_held_bytes`: these alone,
    what a recomputing stage keeps beside its policy's outputs), so that a split through
    an activation that nothing on its own side saves (the input of a matmul on the next
    stage) counts what the pipeline holds of it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx

from runtime.messages import layout
from runtime.offload import MIN_BYTES

from .nodes import compute_nodes, storage_key, tensors
from .profile import _bind, _flash_saved

__all__ = ["Passed", "stage_batch_bytes", "stage_held_bytes", "stage_offloadable", "stage_passed_bytes", "stage_saved_bytes",
           "stage_unsaved_bytes"]


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


def stage_held_bytes(gm: torch.fx.GraphModule, values: dict[torch.fx.Node, Any], stage_of: dict[str, int],
                     stages: int, rank_of: RankOf | None = None) -> list[int]:
    """Bytes each stage's runner holds per microbatch whatever its nodes save ([Note: what
    the pipeline holds per microbatch]): the messages it received and the storages of
    what it sends that are not their own message."""
    return [sum(k.values()) for k in _held(gm, values, stage_of, stages, rank_of)]


def stage_batch_bytes(gm: torch.fx.GraphModule, values: dict[torch.fx.Node, Any], stage_of: dict[str, int],
                      stages: int, rank_of: RankOf) -> list[int]:
    """Per stage, the storages of the batch inputs that no stage of its rank reads, on the
    rank's first stage: every rank splits the whole batch into microbatches, views of the
    caller's tensors (runtime/microbatches.split_inputs), and holds them through the step."""
    first: dict[int, int] = {}
    for k in range(stages):
        first.setdefault(rank_of(k), k)
    found = [0] * stages
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            reading = {rank_of(stage_of[u.name]) for u in node.users if u.name in stage_of}
            for rank, k in first.items():
                found[k] += 0 if rank in reading else _bytes(values.get(node))
    return found


def stage_unsaved_bytes(gm: torch.fx.GraphModule, values: dict[torch.fx.Node, Any], stage_of: dict[str, int],
                        stages: int, rank_of: RankOf | None = None) -> list[int]:
    """Bytes of the storages each stage's nodes make that it does not keep for backward:
    the generated forward keeps every node's output in a local until it returns, so at
    its end these are alive beside what it keeps (a soft-capped attention's scores before
    and after each step)."""
    kept = _kept(gm, values, stage_of, stages, rank_of)
    params = {storage_key(p) for p in gm.parameters()} | {storage_key(b) for b in gm.buffers()}
    made: list[dict[str, int]] = [{} for _ in range(stages)]
    for node in compute_nodes(gm):
        k, base = stage_of.get(node.name, -1), _base(node)
        if k >= 0 and stage_of.get(base.name) == k and ("value", base.name) not in kept[k]:
            made[k][base.name] = sum(t.untyped_storage().nbytes() for t in tensors(values.get(base))
                                     if storage_key(t) not in params)
    return [sum(m.values()) for m in made]


def stage_offloadable(gm: torch.fx.GraphModule, values: dict[torch.fx.Node, Any], stage_of: dict[str, int],
                      stages: int, rank_of: RankOf | None = None) -> list[list[int]]:
    """Per stage, the bytes of each saved storage that offloading may move, in the order
    the stage's forward saves them: not its inputs (received, or of the batch), nor what
    the pipeline holds anyway (its outputs: [Note: what the pipeline holds per
    microbatch]), nor any under `runtime.offload.MIN_BYTES` ([Note: activation
    offloading] in runtime/offload.py)."""
    batch = {n.name for n in gm.graph.nodes if n.op == "placeholder"}
    held = _held(gm, values, stage_of, stages, rank_of)
    return [[n for key, n in k.items() if key[0] != "input" and not (key[0] == "value" and key[1] in batch)
             and key not in h and n >= MIN_BYTES] for k, h in zip(_kept(gm, values, stage_of, stages, rank_of), held)]


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
    """Per stage, its saved storages by key ([Note: saved bytes per stage]) and those the
    pipeline holds ([Note: what the pipeline holds per microbatch]); a received value is
    its whole message, `("input", maker's stage)`."""
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
                elif not batch and there != k:  # received: the message it came in, below
                    continue
                else:  # a microbatch of the batch: its own bytes (the Note)
                    kept[k][("value", base)] = max(own if batch else full, kept[k].get(("value", base), 0))
    sent_alone = {("value", _base(v).name) for v in _own_messages(values, _messages(gm, stage_of, rank_of))}
    for k, held in enumerate(_held(gm, values, stage_of, stages, rank_of)):
        for alone in sent_alone:
            kept[k].pop(alone, None)  # kept by its send to the step's end (the walk's `sent`)
        for what, n in held.items():
            kept[k][what] = max(n, kept[k].get(what, 0))
    return kept


def _held(gm: torch.fx.GraphModule, values: dict[torch.fx.Node, Any], stage_of: dict[str, int], stages: int,
          rank_of: RankOf | None) -> list[dict[Any, int]]:
    """Per stage, the storages its runner holds per microbatch by key ([Note: what the
    pipeline holds per microbatch])."""
    held: list[dict[Any, int]] = [{} for _ in range(stages)]
    pairs = _messages(gm, stage_of, rank_of)
    alone = _own_messages(values, pairs)
    for (a, c), nodes in pairs.items():
        shapes = [list(t.shape) for n in nodes for t in tensors(values.get(n))]
        dtypes = [t.dtype for n in nodes for t in tensors(values.get(n))]
        held[c][("input", a)] = layout(shapes, dtypes)[1] if len(shapes) > 1 else _own(values.get(nodes[0]))
        for node in nodes:
            base = _base(node)
            if node not in alone and stage_of.get(base.name) == a:  # else in a message it received, or the batch
                held[a][("value", base.name)] = max(_bytes(values.get(base)), _own(values.get(node)))
    return held


def _messages(gm: torch.fx.GraphModule, stage_of: dict[str, int], rank_of: RankOf | None
              ) -> dict[tuple[int, int], list[torch.fx.Node]]:
    """The values each stage sends each stage of another rank, by (sender, receiver)."""
    pairs: dict[tuple[int, int], list[torch.fx.Node]] = {}
    for node in compute_nodes(gm):
        a = stage_of.get(node.name, -1)
        readers = {stage_of[u.name] for u in node.users if stage_of.get(u.name, a) != a}
        for c in sorted(readers):
            if a >= 0 and (rank_of is None or rank_of(a) != rank_of(c)):
                pairs.setdefault((a, c), []).append(node)
    return pairs


def _own_messages(values: dict[torch.fx.Node, Any], pairs: dict[tuple[int, int], list[torch.fx.Node]]
                  ) -> set[torch.fx.Node]:
    """The values sent as their own message: the only tensor of their pair, contiguous,
    filling their storage (`runtime.p2p` sends it as it is)."""
    alone = set()
    for nodes in pairs.values():
        found = [t for n in nodes for t in tensors(values.get(n))]
        if len(found) == 1 and found[0].is_contiguous() and found[0].untyped_storage().nbytes() == _own(found[0]):
            alone.add(nodes[0])
    return alone


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


def _own(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(value))
