"""What a plan will cost: the manifest's `predicted` block, from the step simulator.

`simulate_plan` turns a Plan and its node costs into the simulator's inputs: each stage's
forward and backward time per microbatch (the loss's added to the last), one alpha-beta
message per stage pair that exchanges values (and what posting it costs both ends), the
loss all-reduce that ends every step, the all-reduce of each tied parameter's gradient
among its copies, the data-parallel ring all-reduce of each stage's gradients that the
last microbatch's backward cannot hide, and with ZeRO-1 the broadcast of the parameters
each replica updated.  `predict` adds MFU and the per-stage figures.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any

import torch
import torch.fx

from ..cost.costmodel import message_s, pair_bytes
from ..cost.nodes import compute_nodes, selective_keeps
from ..cost.hardware import Hardware
from ..ir import NodeCost, Plan
from ..cost.roofline import BACKWARD_FLOP_FACTOR, mfu, ring_allreduce_s, ring_broadcast_s
from ..solve.offload import exposed_s
from .memory_terms import node_reads, plan_memory
from .simulate import Simulation
from .step import StepInputs, simulate_step

__all__ = ["mfu_peak", "pipeline_link", "pipeline_posts", "predict", "rounded", "simulate_plan", "stage_message_s",
           "step_inputs", "tied_allreduce_s", "zero_broadcast_s"]


def predict(gm: torch.fx.GraphModule, plan: Plan, costs: dict[str, NodeCost], hardware: Hardware,
            cost_source: str, model_flops: int | None = None, loss: NodeCost | None = None,
            precision: str = "fp32", optimizer_factor: float | None = None,
            values: dict[torch.fx.Node, Any] | None = None) -> dict[str, Any]:
    """The manifest's `predicted` block for `plan`; `model_flops` is one microbatch's
    forward of the whole model (default: the sum over `costs`, right when tp = 1); `loss`
    the loss_fn's cost per microbatch (`partitioner.cost.loss`); the MFU is of the peak
    `mfu_peak` finds, which the block names.  With `optimizer_factor` (optimizer-state bytes
    per parameter byte) each stage's `memory_bytes` is its part of its rank's peak walked
    over the schedule ([Note: the memory walk] in memory.py), what each stage saves counted
    on `values` where given (one microbatch's value of every node); else the plan's own."""
    inputs = step_inputs(gm, plan, costs, hardware, loss)
    sim = simulate_step(inputs)  # [Note: one predicted step]
    forward = model_flops if model_flops is not None else sum(c.flops for c in costs.values())
    flops = forward * (1 + BACKWARD_FLOP_FACTOR) * plan.microbatches * plan.dp
    report = plan.report
    peak_name, peak = mfu_peak(gm, costs, hardware, precision)
    memory = ([s.memory_bytes for s in plan.stages] if optimizer_factor is None
              else plan_memory(gm, plan, costs, loss, optimizer_factor, values, hardware.copies_overlap))
    block = rounded({
        "step_time_s": sim.step_time_s,
        "mfu": mfu(flops, sim.step_time_s, plan.pp * plan.tp * plan.dp, peak),
        "mfu_peak": peak_name,
        "mfu_peak_flops": peak,
        "cost_source": cost_source,
        "hardware": hardware.name,
        "stages": [{"time_s": s.time_s, "compute_s": s.compute_s, "memory_bytes": memory[s.index],
                    "param_bytes": s.param_bytes, "send_bytes": s.send_bytes, "recv_bytes": s.recv_bytes,
                    "peak_inflight": sim.peak_inflight[s.index]}
                   for s in plan.stages],
        "solver": {} if report is None else {
            "method": report.method, "objective_s": report.objective_s, "lower_bound_s": report.lower_bound_s,
            "gap": report.gap, "status": report.status, "blocks": report.blocks, "nodes": report.nodes},
    })
    return {**block, "simulation": inputs.to_dict()}  # unrounded: show --timeline runs it again to the same step


def mfu_peak(gm: torch.fx.GraphModule, costs: dict[str, NodeCost], hardware: Hardware, precision: str
             ) -> tuple[str, float]:
    """(name, FLOP/s) of the peak a plan's MFU is quoted against ([Note: a peak per dtype] in
    cost/hardware.py): that of the dtype most of the FLOPs of `costs` run in (each node's
    output dtype), else, where no node counts FLOPs, that of `precision`."""
    flops: dict[torch.dtype, int] = {}
    for node in compute_nodes(gm):
        dtype = getattr(node.meta.get("tensor_meta"), "dtype", None)
        if isinstance(dtype, torch.dtype) and dtype.is_floating_point and node.name in costs:
            flops[dtype] = flops.get(dtype, 0) + costs[node.name].flops
    if not any(flops.values()):
        return hardware.precision_peak(precision)
    return hardware.named_peak(max(flops, key=lambda d: flops[d]))


def rounded(block: Any, key: str = "") -> Any:
    """`block` (the manifest's numbers) rounded to what they mean: seconds to 6 significant
    digits (a step's time is not known to a nanosecond of a second), ratios such as MFU and
    the solver's gap to 4, byte counts as ints; dicts and lists are rounded through."""
    if isinstance(block, dict):
        return {k: rounded(v, k) for k, v in block.items()}
    if isinstance(block, list):
        return [rounded(v, key) for v in block]
    if isinstance(block, float) and key.endswith("_bytes") and block.is_integer():
        return int(block)
    if isinstance(block, float) and math.isfinite(block):
        return float(f"{block:.{6 if key.endswith('_s') else 4}g}")
    return block


def simulate_plan(gm: torch.fx.GraphModule, plan: Plan, costs: dict[str, NodeCost], hardware: Hardware,
                  loss_cost: NodeCost | None = None) -> Simulation:
    """The step as the schedule will run it: stage compute and the loss, one message per stage
    pair (and what posting it costs both ends), the loss all-reduce, the all-reduce of tied
    parameters' gradients, the data-parallel all-reduce of each stage's gradients where
    the backward cannot hide it, and ZeRO-1's broadcast of the updated parameters."""
    return simulate_step(step_inputs(gm, plan, costs, hardware, loss_cost))


def _recomputed_s(gm: torch.fx.GraphModule, plan: Plan, costs: dict[str, NodeCost]) -> list[float]:
    """The forward each stage's backward runs again first: all of it ("full"), that of the
    ops selective recomputation does not keep, or none ([Note: recomputation policies] in
    runtime/recompute.py)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    return [sum(costs[n].forward_s for n in s.nodes
                if plan.policy(k) == "full" or plan.policy(k) == "selective" and not selective_keeps(nodes[n]))
            for k, s in enumerate(plan.stages)]


def step_inputs(gm: torch.fx.GraphModule, plan: Plan, costs: dict[str, NodeCost], hardware: Hardware,
                loss_cost: NodeCost | None = None) -> StepInputs:
    """What `simulate_step` takes for `plan` (see `simulate_plan`)."""
    stage_of = plan.stage_of()
    forward = [sum(costs[n].forward_s for n in s.nodes) for s in plan.stages]
    backward = [sum(costs[n].backward_s for n in s.nodes) for s in plan.stages]
    weight = [sum(costs[n].weight_s for n in s.nodes) for s in plan.stages]  # what a zero-bubble W runs
    backward = [b + f for f, b in zip(_recomputed_s(gm, plan, costs), backward)]  # run again before the backward
    for s, share in zip(plan.stages, plan.offload):  # [Note: offloaded activations] in solve/offload.py
        out, back = exposed_s(s.activation_bytes, share, forward[s.index], backward[s.index], hardware)
        forward[s.index], backward[s.index] = forward[s.index] + out, backward[s.index] + back
    weight_share = [w / b if b > 0 else 0.0 for w, b in zip(weight, backward)]
    last = plan.num_stages - 1
    traffic = pair_bytes((stage_of[node.name],
                          [last if u.op == "output" else stage_of.get(u.name, stage_of[node.name]) for u in node.users],
                          costs[node.name].output_bytes) for node in compute_nodes(gm))
    alpha, beta = pipeline_link(hardware, plan.pp, plan.tp)
    links = {pair: message_s(alpha, beta, nbytes) for pair, nbytes in traffic.items()}  # [Note: the cost of a boundary]
    # The loss on the last stage, per microbatch: the loss_fn's cost where the compile took
    # it (`partitioner.cost.loss`), else one typical node, the median node's forward and
    # backward, or, if longer, one pass over the model's output at memory bandwidth.
    nodes = compute_nodes(gm)
    out_bytes = sum(costs[n.name].output_bytes for n in nodes if any(u.op == "output" for u in n.users))
    stream = out_bytes / hardware.memory_bandwidth
    loss = (max(stream, statistics.median(costs[n.name].forward_s for n in nodes)) if nodes else stream,
            max(stream, statistics.median(costs[n.name].backward_s for n in nodes)) if nodes else stream)
    if loss_cost is not None:
        loss = (loss_cost.forward_s, loss_cost.backward_s)
    # The step ends with the all-reduce of the 0-dim loss over every rank: its latency.
    final = (hardware.allreduce_latency_s or hardware.p2p_alpha_s) if plan.pp * plan.tp * plan.dp > 1 else 0.0
    send, receive = pipeline_posts(hardware, plan.pp, plan.tp)
    inputs = StepInputs(tuple(forward), tuple(backward), tuple((a, b, s) for (a, b), s in sorted(links.items())),
                        plan.schedule, plan.pp, plan.microbatches, plan.virtual_stages, send_s=send, recv_s=receive,
                        loss_s=loss, final_s=final, weight_share=tuple(weight_share), ahead=hardware.receives_ahead,
                        after_s=tied_allreduce_s(gm, plan, hardware))
    if plan.dp == 1:
        return inputs
    # Gradients are all-reduced in buckets during the last microbatch's backward: what the
    # backward of that microbatch cannot cover is added to the step (all of it where the
    # collectives share the compute's cores: gloo on the CPU).
    alpha, beta = hardware.ring_link(across_nodes=plan.pp * plan.tp * plan.dp > hardware.devices_per_node)
    hidden = backward if hardware.overlaps_comm else [0.0] * len(backward)
    exposed = max(max(0.0, ring_allreduce_s(s.param_bytes, plan.dp, alpha, beta) - hidden[s.index])
                  for s in plan.stages)
    return dataclasses.replace(inputs, after_s=inputs.after_s + exposed + zero_broadcast_s(plan, alpha, beta))


def zero_broadcast_s(plan: Plan, alpha_s: float, beta_s_per_byte: float) -> float:
    """What ZeRO-1 adds to a step ([Note: ZeRO-1] in runtime/optim.py): after the optimizer
    step each of the dp replicas of a pipeline rank broadcasts the parameters it updated
    (1/dp of the rank's parameter bytes) to the others, one part after another, with no
    compute left to hide them; the slowest pipeline rank's.  The update itself, which ZeRO-1
    cuts to 1/dp, is not costed with or without it.  0 without ZeRO-1 or data parallelism."""
    if not plan.zero or plan.dp == 1:
        return 0.0
    held = [0] * plan.pp
    for s in plan.stages:
        held[plan.rank_of(s.index)] += s.param_bytes
    return max(plan.dp * ring_broadcast_s(nbytes / plan.dp, plan.dp, alpha_s, beta_s_per_byte) for nbytes in held)


def pipeline_link(hardware: Hardware, pp: int, tp: int) -> tuple[float, float]:
    """Latency and seconds per byte between neighbouring pipeline stages: a stage's tp
    ranks are neighbours in rank order, so the pipeline leaves a node once pp x tp ranks
    outgrow it."""
    return _link(hardware, across_nodes=pp * tp > hardware.devices_per_node)


def stage_message_s(hardware: Hardware, pp: int, tp: int) -> float:
    """What one pipeline message costs each of its two ends' own time, as the solver
    charges it (`PartitionProblem.comm_alpha_s`; the bytes apart).  Where receives are
    posted a compute ahead (gloo: [Note: receives posted ahead] in runtime/schedule/lowering.py) the
    message moves during that compute, and a stage pays posting it: at each end of a
    boundary one send and one receive a microbatch, so their mean per message.  Elsewhere
    (NCCL) a receive is posted where it is waited for, and its end pays the latency."""
    alpha, _ = pipeline_link(hardware, pp, tp)
    if not hardware.receives_ahead:
        return alpha
    send, receive = pipeline_posts(hardware, pp, tp)
    return (send + receive) / 2


def tied_allreduce_s(gm: torch.fx.GraphModule, plan: Plan, hardware: Hardware) -> float:
    """The all-reduces that end a step by summing the gradient of each parameter read on
    several pipeline positions (tied embeddings) over every copy (`runtime.comm.TiedGrads`:
    one collective per parameter, after the last backward, so nothing hides it)."""
    stage_of = plan.stage_of()
    held: dict[int, tuple[int, set[int]]] = {}  # storage -> (bytes, positions holding a copy)
    for name, reads in node_reads(gm).items():
        for key in reads.trained:
            held.setdefault(key, (reads.params[key], set()))[1].add(plan.rank_of(stage_of[name]))
    alpha, beta = hardware.ring_link(across_nodes=plan.pp * plan.tp * plan.dp > hardware.devices_per_node)
    return sum(ring_allreduce_s(nbytes, len(positions) * plan.dp, alpha, beta)
               for nbytes, positions in held.values() if len(positions) > 1)


def pipeline_posts(hardware: Hardware, pp: int, tp: int) -> tuple[float, float]:
    """What posting one pipeline send and one receive costs the rank that posts it: the
    profile's measured costs inside a node (`Hardware.p2p_send_post_s`, on the CPU), else
    the link's latency for a send and nothing for a receive."""
    if pp * tp > hardware.devices_per_node and hardware.inter_node_bandwidth > 0:
        return hardware.inter_node_latency_s, 0.0
    return hardware.send_post_s, hardware.p2p_recv_post_s


def _link(hardware: Hardware, across_nodes: bool) -> tuple[float, float]:
    """Latency and seconds per byte of a link inside a node, or between nodes."""
    if across_nodes and hardware.inter_node_bandwidth > 0:
        return hardware.inter_node_latency_s, 1.0 / hardware.inter_node_bandwidth
    return hardware.p2p_alpha_s, hardware.p2p_beta_s_per_byte
