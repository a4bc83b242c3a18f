"""The partition problem of a traced graph, and the Plan of a solved one.

    coarse_graph(traced, costs, sharded) -> Coarse      the blocks (coarsen.py), once per graph
    pose(coarse, setting, hardware)                      the PartitionProblem for one `Setting`
    make_plan(problem, blocks, assignment, report, mesh) with each stage's cost-model terms

A `Coarse` graph is shared by every stage and microbatch count that `--devices` tries; a
`Setting` is what one problem is posed for: the mesh, the schedule and the limits.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch

from runtime.recompute import parse_policy

from ..cost.costmodel import remote, stage_pairs
from ..cost.hardware import Hardware
from ..cost.nodes import compute_nodes, param_names, selective_keeps, working_nodes
from ..ir import (BlockCost, Edge, GraphNode, NodeCost, PartitionProblem, Plan, SolverReport, StagePlan,
                  optimizer_state_factor)
from ..predict.predict import pipeline_link, stage_message_s
from ..tp import Sharded
from ..trace.buffers import mutated_buffers
from ..trace.passes import is_tensor_node, node_module
from ..trace.trace import Traced
from .coarsen import build_problem, coarsen
from .solve import stage_costs

__all__ = ["Coarse", "MAX_BLOCKS", "Setting", "coarse_graph", "device_memory", "make_plan", "pose"]

MAX_BLOCKS = 160


@dataclass(frozen=True)
class Setting:
    """What one partition problem is posed for: the mesh, the schedule and the limits."""

    pp: int  # pipeline ranks
    microbatches: int
    schedule: str
    tp: int = 1
    dp: int = 1
    virtual_stages: int = 1  # stages per pipeline rank (the interleaved schedule's, 2 for zb-v)
    memory: int | None = None  # bytes per device (a pipeline rank); None: the device's own (`device_memory`)
    optimizer: str = "adam"
    recompute: bool | str | None = False  # True or "full", "selective", False or None ([Note: recomputation policies])
    zero: int = 0  # 1: optimizer state sharded across the dp replicas (ZeRO-1), each keeps 1/dp of it
    offload: bool = False  # activations may go to the host ([Note: offloaded activations] in solve/offload.py)

    @property
    def stages(self) -> int:
        """The stages the graph is split into: `virtual_stages` per pipeline rank."""
        return self.pp * self.virtual_stages


@dataclass(frozen=True)
class Coarse:
    """A graph coarsened into blocks, with its parameters' sizes (each rank's shard)."""

    blocks: list[BlockCost]
    edges: list[Edge]
    param_bytes: dict[str, int]
    #: the parameters are mostly 16-bit: optimizer state is counted as mixed precision keeps it
    mixed_precision: bool
    #: the largest node output (a forward's working set at least) and parameter (the
    #: optimizer step's temporaries are two of it), each rank's shard
    largest_output: int = 0
    largest_param: int = 0
    #: the problem posed once (per recompute), that `pose` copies with other counts
    templates: dict[str | None, PartitionProblem] = field(default_factory=dict, compare=False, repr=False)


def coarse_graph(traced: Traced, costs: dict[str, NodeCost], sharded: Sharded | None = None,
                 loss: NodeCost | None = None) -> Coarse:
    """`traced` coarsened into blocks; `loss` (the loss_fn's cost per microbatch) goes
    with the graph's output, which the solver keeps in the last stage."""
    gm = traced.gm
    named = list(gm.named_parameters(remove_duplicate=False))
    params = {name for name, _ in named}
    shards = sharded.params if sharded is not None else {}
    param_bytes = {name: p.numel() * p.element_size() // (sharded.tp if sharded and name in shards else 1)
                   for name, p in named}
    compute, working, mutated = set(compute_nodes(gm)), working_nodes(gm), mutated_buffers(gm)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    nodes = [
        GraphNode(
            name=n.name,
            inputs=tuple(a.name for a in n.all_input_nodes if a in compute),
            cost=costs[n.name],
            module=node_module(n),
            params=param_names(n, params),
            tensor_output=is_tensor_node(n),
            computes=n in working,
            mutated=mutated.get(n.name, ()),
            saved=selective_keeps(n),
        )
        for n in gm.graph.nodes if n in compute
    ]
    # The graph's output, as a node that the solver keeps in the last stage, costing the loss.
    out_cost = replace(loss, name=output.name) if loss is not None else NodeCost(output.name)
    nodes.append(GraphNode(name=output.name, inputs=tuple(a.name for a in output.all_input_nodes if a in compute),
                           cost=out_cost, module="", params=(), is_output=True, computes=False))
    blocks, edges = coarsen(nodes, max_blocks=MAX_BLOCKS, param_bytes=param_bytes)
    largest = max((costs[n.name].output_bytes for n in compute), default=0)
    return Coarse(blocks, edges, param_bytes, _mostly_16_bit(named), largest, max(param_bytes.values(), default=0))


def _mostly_16_bit(named: Sequence[tuple[str, torch.Tensor]]) -> bool:
    """Whether most parameter bytes are 16-bit floats (bfloat16, float16)."""
    seen: dict[int, torch.Tensor] = {id(p): p for _, p in named}
    half = sum(p.numel() for p in seen.values() if p.is_floating_point() and p.element_size() == 2)
    return half * 2 > sum(p.numel() for p in seen.values())


def pose(coarse: Coarse, mesh: Setting, hardware: Hardware) -> PartitionProblem:
    """The problem of splitting `coarse` into `mesh.stages` stages for `mesh`."""
    _, beta = pipeline_link(hardware, mesh.pp, mesh.tp)
    return replace(
        _template(coarse, mesh.recompute), stages=mesh.stages, microbatches=mesh.microbatches,
        schedule=mesh.schedule,
        memory_limit_bytes=mesh.memory if mesh.memory is not None else device_memory(hardware, mesh.pp * mesh.tp * mesh.dp),
        optimizer_factor=optimizer_state_factor(mesh.optimizer, coarse.mixed_precision) / (mesh.dp if mesh.zero else 1),
        comm_alpha_s=stage_message_s(hardware, mesh.pp, mesh.tp),
        comm_beta_s_per_byte=beta,
        virtual_stages=mesh.virtual_stages,
        offload=mesh.offload,
        working_bytes=coarse.largest_output,
        step_bytes=2 * coarse.largest_param,
        buckets=mesh.dp > 1,
        holds_messages=True,
    )


def _template(coarse: Coarse, recompute: bool | str | None) -> PartitionProblem:
    """`coarse`'s problem for one stage, built once per policy; every problem posed from it
    shares its tuples, which the cost model's tables are cached by (`costmodel`)."""
    recompute = parse_policy(recompute)
    if recompute not in coarse.templates:
        made = build_problem(coarse.blocks, coarse.edges, 1, 1, param_bytes=coarse.param_bytes, recompute=recompute)
        other = next(iter(coarse.templates.values()), None)
        if other is not None:
            made = replace(made, edges=other.edges, block_params=other.block_params,
                           param_bytes_by_name=other.param_bytes_by_name, block_param_bytes=other.block_param_bytes)
        coarse.templates[recompute] = made
    return coarse.templates[recompute]


def device_memory(hardware: Hardware, ranks: int) -> int:
    """The default --memory: a device's own; on the CPU every rank shares this machine's RAM."""
    return hardware.memory_bytes // max(1, ranks) if hardware.name == "cpu" else hardware.memory_bytes


def make_plan(problem: PartitionProblem, blocks: list[Any], assignment: tuple[int, ...], report: SolverReport | None,
              mesh: Setting) -> Plan:
    """The Plan for a stage per block, with each stage's terms of the solver's cost model."""
    costs = stage_costs(problem, assignment)
    stage_nodes: list[list[str]] = [[] for _ in range(problem.stages)]
    for block, stage in zip(blocks, assignment):
        stage_nodes[stage].extend(n for n in block.nodes if n != "output")
    sent = [0] * problem.stages
    received = [0] * problem.stages
    pairs = stage_pairs(problem, assignment)
    for (a, b), nbytes in remote(pairs, problem.placement).items():  # between ranks: the rest stays in memory
        sent[a] += nbytes
        received[b] += nbytes
    stage_plans = tuple(
        StagePlan(index=k, nodes=tuple(stage_nodes[k]), time_s=c.time_s, compute_s=c.compute_s,
                  comm_s=c.time_s - c.compute_s, memory_bytes=int(c.memory_bytes), param_bytes=c.weight_bytes,
                  activation_bytes=c.activation_bytes, send_bytes=sent[k], recv_bytes=received[k],
                  recompute=problem.policy)
        for k, c in enumerate(costs)
    )
    return Plan(stages=stage_plans, schedule=mesh.schedule, microbatches=mesh.microbatches, pp=mesh.pp,
                tp=mesh.tp, dp=mesh.dp, virtual_stages=mesh.virtual_stages, report=report, recompute=problem.policy == "full",
                zero=mesh.zero)
