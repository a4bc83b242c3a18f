"""What a plan will cost: the manifest's `predicted` block, from the step simulator.

`simulate_plan` turns a Plan and its node costs into the simulator's inputs: each stage's
forward and backward time per microbatch, one alpha-beta message per stage pair that
exchanges values, and the data-parallel ring all-reduce of each stage's gradients that
the last microbatch's backward cannot hide.  `predict` adds MFU and the per-stage figures.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.fx

from .cost import compute_nodes
from .hardware import Hardware
from .ir import NodeCost, Plan
from .roofline import BACKWARD_FLOP_FACTOR, mfu, ring_allreduce_s
from .simulate import Simulation, simulate

__all__ = ["predict", "simulate_plan"]


def predict(gm: torch.fx.GraphModule, plan: Plan, costs: dict[str, NodeCost], hardware: Hardware,
            cost_source: str) -> dict[str, Any]:
    """The manifest's `predicted` block for `plan`."""
    sim = simulate_plan(gm, plan, costs, hardware)
    flops = sum(c.flops for c in costs.values()) * (1 + BACKWARD_FLOP_FACTOR) * plan.microbatches * plan.dp
    report = plan.report
    return {
        "step_time_s": sim.step_time_s,
        "mfu": mfu(flops, sim.step_time_s, plan.pp * plan.tp * plan.dp, hardware.peak_flops),
        "cost_source": cost_source,
        "hardware": hardware.name,
        "stages": [{"time_s": s.time_s, "compute_s": s.compute_s, "memory_bytes": s.memory_bytes,
                    "param_bytes": s.param_bytes, "send_bytes": s.send_bytes, "recv_bytes": s.recv_bytes,
                    "peak_inflight": sim.peak_inflight[s.index]}
                   for s in plan.stages],
        "solver": {} if report is None else {
            "method": report.method, "objective_s": report.objective_s, "lower_bound_s": report.lower_bound_s,
            "gap": report.gap, "status": report.status, "blocks": report.blocks, "nodes": report.nodes},
    }


def simulate_plan(gm: torch.fx.GraphModule, plan: Plan, costs: dict[str, NodeCost], hardware: Hardware) -> Simulation:
    """The step as the schedule will run it: stage compute, one message per stage pair, and
    the data-parallel all-reduce of each stage's gradients where the backward cannot hide it."""
    stage_of = plan.stage_of()
    forward = [sum(costs[n].forward_s for n in s.nodes) for s in plan.stages]
    backward = [sum(costs[n].backward_s for n in s.nodes) for s in plan.stages]
    traffic: dict[tuple[int, int], int] = {}
    last = plan.num_stages - 1
    for node in compute_nodes(gm):
        a = stage_of[node.name]
        readers = {last if u.op == "output" else stage_of.get(u.name, a) for u in node.users}
        for b in sorted(readers - {a}):
            traffic[(a, b)] = traffic.get((a, b), 0) + costs[node.name].output_bytes
    alpha, beta = _link(hardware, across_nodes=plan.pp > hardware.devices_per_node)
    links = {pair: alpha + nbytes * beta for pair, nbytes in traffic.items()}
    sim = simulate(forward, backward, links, plan.schedule, plan.pp, plan.microbatches, plan.virtual_stages)
    if plan.dp == 1:
        return sim
    # Gradients are all-reduced in buckets during the last microbatch's backward: what the
    # backward of that microbatch cannot cover is added to the step.
    alpha, beta = _link(hardware, across_nodes=plan.pp * plan.tp * plan.dp > hardware.devices_per_node)
    exposed = max(max(0.0, ring_allreduce_s(s.param_bytes, plan.dp, alpha, beta) - backward[s.index])
                  for s in plan.stages)
    return dataclasses.replace(sim, step_time_s=sim.step_time_s + exposed)


def _link(hardware: Hardware, across_nodes: bool) -> tuple[float, float]:
    """Latency and seconds per byte of a link inside a node, or between nodes."""
    if across_nodes and hardware.inter_node_bandwidth > 0:
        return hardware.inter_node_latency_s, 1.0 / hardware.inter_node_bandwidth
    return hardware.p2p_alpha_s, hardware.p2p_beta_s_per_byte
