"""The terms of [Note: the memory walk] for each stage of a plan, from the traced graph
and its node costs: what `partitioner.predict.memory.rank_peaks` walks."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch
import torch.fx

from runtime import offload

from ..cost.nodes import compute_nodes, selective_keeps, storage_key
from ..cost.saved import (Passed, stage_batch_bytes, stage_held_bytes, stage_offloadable, stage_passed_bytes, stage_saved_bytes,
                          stage_unsaved_bytes)
from ..ir import NodeCost, Plan, StagePlan
from ..trace.passes import get_attr
from .memory import StageBytes, rank_peaks, stage_shares

__all__ = ["Reads", "node_reads", "plan_memory", "stage_bytes"]

#: gradients alive at once in a backward, in units of the stage's largest node output
#: ([Note: the memory walk] in memory.py)
_FLOWING = 1
#: a forward's working set beyond what it keeps, likewise
_WORKING = 1


def plan_memory(gm: torch.fx.GraphModule, plan: Plan, costs: dict[str, NodeCost], loss: NodeCost | None,
                optimizer_factor: float, values: dict[torch.fx.Node, Any] | None = None,
                copies_overlap: bool = True) -> list[int]:
    """Each stage's part of its rank's walked peak ([Note: the memory walk]); `values`
    (one microbatch's value of every node) counts what each stage saves once per storage
    ([Note: saved bytes per stage] in cost/saved.py) where they are this graph's, else the
    nodes' own counts are summed; `copies_overlap`: offloading's copies run beside the
    compute (`Hardware.copies_overlap`), else inside it, brought back `offload.ahead()`
    compute actions ahead ([Note: offloaded activations] in solve/offload.py)."""
    ran = values is not None and all(n in values for n in compute_nodes(gm))  # not a graph a tp split rewrote
    stages = stage_bytes(gm, plan, costs, loss, optimizer_factor, *_saved(gm, plan, costs, values if ran else None))
    if ran and values is not None:  # the batch a rank splits and none of its stages reads
        batch = stage_batch_bytes(gm, values, plan.stage_of(), plan.num_stages, plan.rank_of)
        stages = [replace(s, persistent=s.persistent + b) for s, b in zip(stages, batch)]
    peaks = rank_peaks(plan.schedule, plan.pp, plan.microbatches, plan.virtual_stages, stages,
                       step_transient=2 * _graph(gm).largest_param, ahead=None if copies_overlap else offload.ahead())
    return stage_shares(peaks, [plan.rank_of(k) for k in range(plan.num_stages)], stages)


def _saved(gm: torch.fx.GraphModule, plan: Plan, costs: dict[str, NodeCost], values: dict[torch.fx.Node, Any] | None
           ) -> tuple[list[int], list[Passed], list[int], list[list[int]] | None, list[int] | None, list[int] | None]:
    """Per stage, what it keeps for backward per microbatch, what it passes in memory to
    stages of its rank, the gradients it makes of what it takes from them ([Note: saved
    bytes per stage]), the storages offloading may move, what its runner holds whatever
    it saves ([Note: what the pipeline holds per microbatch]) and what its forward makes
    and does not keep: counted on `values` where given; else the nodes' own counts
    summed, and the rest left to `stage_bytes`'s defaults."""
    if values is None:
        none = [0] * plan.num_stages
        return ([sum(costs[n].activation_bytes for n in s.nodes) for s in plan.stages], [Passed()] * plan.num_stages,
                none, None, None, None)
    stage_of, count = plan.stage_of(), plan.num_stages
    passed, taken = stage_passed_bytes(gm, values, stage_of, count, plan.rank_of)
    movable = stage_offloadable(gm, values, stage_of, count, plan.rank_of) if plan.offload else None
    return (stage_saved_bytes(gm, values, stage_of, count, plan.rank_of), passed, taken, movable,
            stage_held_bytes(gm, values, stage_of, count, plan.rank_of),
            stage_unsaved_bytes(gm, values, stage_of, count, plan.rank_of))


def stage_bytes(gm: torch.fx.GraphModule, plan: Plan, costs: dict[str, NodeCost], loss: NodeCost | None,
                optimizer_factor: float, saved_bytes: list[int], passed: Sequence[Passed] = (),
                taken: Sequence[int] = (), movable: Sequence[Sequence[int]] | None = None,
                holds: Sequence[int] | None = None, unsaved: Sequence[int] | None = None) -> list[StageBytes]:
    """What each stage of `plan` holds ([Note: the memory walk]); `saved_bytes`: what each
    keeps for backward per microbatch; `passed` and `taken`: what it passes to stages of
    its rank and the gradients of what it takes from them; `movable`: the storages each
    may offload, in the order saved; `holds`: what its runner holds whatever it saves (its
    received inputs where not given); `unsaved`: what its forward makes and does not keep,
    alive until the forward returns (its largest node output where not given)."""
    params, buffers = _stage_params(gm, plan), _stage_buffers(gm, plan)
    out_bytes = _output_bytes(gm, costs)
    nodes = _graph(gm).nodes
    last = plan.num_stages - 1
    result = []
    for s in plan.stages:
        weights = s.param_bytes - params[s.index]  # the plan's own bytes (tensor-parallel shards)
        policy = plan.policy(s.index)
        saved = saved_bytes[s.index]  # a received input a node saves among them
        runner = s.recv_bytes if holds is None else holds[s.index]
        kept = _kept(s, policy, saved, runner, costs, nodes)
        away = _offloaded(plan, s, saved, movable) if plan.offload and policy is None else 0
        loss_saved = (out_bytes + (loss.activation_bytes if loss is not None else out_bytes)
                      if s.index == last else 0)  # the model's output and what the loss saves
        held = kept + loss_saved
        largest = max((costs[n].output_bytes for n in s.nodes), default=0)
        grad_in = s.send_bytes if s.index != last else 0  # the output gradient received
        flowing = _FLOWING * largest
        made = 0 if unsaved is None else saved + unsaved[s.index] - kept  # alive at the forward's end, not kept
        working = max(_WORKING * largest, made)
        backward = grad_in + (s.recv_bytes + _second_forward(s, saved, kept, runner, flowing, costs, nodes) if policy
                              else max(s.recv_bytes, flowing))
        seeds = 0 if policy else sum(costs[n].output_bytes for n in s.nodes if costs[n].param_bytes)
        result.append(StageBytes(round(weights * (1 + optimizer_factor)) + buffers[s.index], weights, held, backward, seeds,
                                 working, splits=s.index > 0 and policy != "selective", offloaded=away,
                                 sent_forward=s.send_bytes, sent_backward=s.recv_bytes,
                                 reduced=weights if plan.dp > 1 else 0, **_in_memory(s.index, passed, taken)))
    return result


def _offloaded(plan: Plan, s: StagePlan, saved: int, movable: Sequence[Sequence[int]] | None) -> int:
    """The bytes stage `s` offloads per microbatch: the first storages it saves up to its
    share, as the runtime chooses them (`offload.share_of`), where they are known; else
    the share of what it saves beside its inputs."""
    if movable is None:
        return round(max(0, saved - s.recv_bytes) * plan.offload[s.index])
    sizes = movable[s.index]
    return sum(sizes[:offload.share_of(sizes, plan.offload[s.index])])


def _in_memory(k: int, passed: Sequence[Passed], taken: Sequence[int]) -> dict[str, int]:
    """Stage `k`'s StageBytes fields for the values passed in memory on its rank."""
    if not passed:
        return {}
    return {"passed": passed[k].storage, "passed_grads": passed[k].grads, "taken_grads": taken[k]}


def _second_forward(s: StagePlan, saved: int, kept: int, runner: int, flowing: int, costs: dict[str, NodeCost],
                    nodes: dict[str, torch.fx.Node]) -> int:
    """A recomputing stage's backward beyond the output gradient and its inputs: its second
    forward and the backward after it, each holding the stage's inputs again.  The
    generated forward keeps each node's output in a local until it returns, so at the end
    of the second forward every output of the stage is alive (views aside; the model's
    output, which the last stage holds for the loss, too); after it, what the policy did
    not keep and the flowing gradient ([Note: the memory walk] in memory.py); `runner`:
    what the runner holds of the microbatch anyway, among `kept`."""
    outputs = sum(costs[n].output_bytes for n in s.nodes
                  if not nodes[n].meta.get("aliases") and not any(u.op == "output" for u in nodes[n].users))
    return max(outputs, saved + flowing) - kept + runner


def _kept(s: StagePlan, policy: str | None, saved: int, held: int, costs: dict[str, NodeCost],
          nodes: dict[str, torch.fx.Node]) -> int:
    """What stage `s` keeps per microbatch in flight under its recomputation policy: all it
    saves (none), what its runner holds (full: its inputs and outputs, [Note: what the
    pipeline holds per microbatch] in cost/saved.py), or that and the outputs of the ops
    selective recomputation keeps, no more than it saves ([Note: recomputation policies]
    in runtime/recompute.py)."""
    if policy is None:
        return saved
    if policy == "full":
        return held
    return min(saved, held + sum(costs[n].output_bytes for n in s.nodes if selective_keeps(nodes[n])))


def _stage_params(gm: torch.fx.GraphModule, plan: Plan) -> list[int]:
    """Per stage, the bytes of the parameters an earlier stage of the same rank reads too
    (a tied weight, which the rank holds once), a tensor-parallel shard of them where the
    plan shards the stage."""
    stage_of = plan.stage_of()
    per_stage: list[dict[int, int]] = [{} for _ in plan.stages]
    for name, reads in node_reads(gm).items():
        per_stage[stage_of[name]].update(reads.params)
    seen: dict[int, set[int]] = {}
    twice = []
    for k, found in enumerate(per_stage):
        rank = seen.setdefault(plan.rank_of(k), set())
        twice.append(sum(n for key, n in found.items() if key in rank) // plan.tp)
        rank.update(found)
    return twice


def _stage_buffers(gm: torch.fx.GraphModule, plan: Plan) -> list[int]:
    """Per stage, the bytes of the buffers it reads (a causal mask, running statistics),
    those an earlier stage of the same rank reads left out."""
    stage_of = plan.stage_of()
    seen: dict[int, set[int]] = {}
    out = [0] * plan.num_stages
    for name, reads in node_reads(gm).items():
        k = stage_of[name]
        held = seen.setdefault(plan.rank_of(k), set())
        for key, nbytes in reads.buffers.items():
            if key not in held:
                held.add(key)
                out[k] += nbytes
    return out


@dataclass(frozen=True)
class Reads:
    """What one compute node reads of the model's state: parameters by storage and buffers
    by identity, each with its bytes, and the storages of those parameters that train."""

    params: dict[int, int]
    buffers: dict[int, int]
    trained: tuple[int, ...]


@dataclass(frozen=True)
class _Graph:
    """What every plan of one graph reads of it, found once (the search walks thousands):
    the `Reads` of each compute node that reads any parameter or buffer, in graph order;
    the nodes by name; the compute nodes the output returns; the largest parameter's bytes."""

    reads: dict[str, Reads]
    nodes: dict[str, torch.fx.Node]
    outputs: tuple[str, ...]
    largest_param: int


_GRAPHS: weakref.WeakKeyDictionary[torch.fx.GraphModule, _Graph] = weakref.WeakKeyDictionary()


def _graph(gm: torch.fx.GraphModule) -> _Graph:
    if gm not in _GRAPHS:
        buffers = {id(b) for b in gm.buffers()}
        reads = {}
        for node in compute_nodes(gm):
            params, bufs, trained = {}, {}, []
            for x in node.all_input_nodes:
                t = get_attr(gm, str(x.target)) if x.op == "get_attr" else None
                if isinstance(t, torch.nn.Parameter):
                    params[storage_key(t)] = t.numel() * t.element_size()
                    trained += [storage_key(t)] if t.requires_grad else []
                elif isinstance(t, torch.Tensor) and id(t) in buffers:
                    bufs[id(t)] = t.untyped_storage().nbytes()
            if params or bufs:
                reads[node.name] = Reads(params, bufs, tuple(trained))
        outputs = tuple(n.name for n in compute_nodes(gm) if any(u.op == "output" for u in n.users))
        _GRAPHS[gm] = _Graph(reads, {n.name: n for n in gm.graph.nodes}, outputs,
                             max((p.numel() * p.element_size() for p in gm.parameters()), default=0))
    return _GRAPHS[gm]


def node_reads(gm: torch.fx.GraphModule) -> dict[str, Reads]:
    """The `Reads` of each compute node of `gm` that reads any parameter or buffer, by name
    in graph order."""
    return _graph(gm).reads


def _output_bytes(gm: torch.fx.GraphModule, costs: dict[str, NodeCost]) -> int:
    """The model's output per microbatch: the last stage's outputs (the logits)."""
    return sum(costs[name].output_bytes for name in _graph(gm).outputs)
