"""Activation offloading in the plan: how much of each stage's activations goes to the host
(`--offload none | all | auto`), the memory that saves and the time the copies cost.

[Note: offloaded activations]
    A stage that offloads a fraction f of what it saves for backward (runtime/offload.py)
    holds on the device, of the activations of its microbatches in flight,
        activation_bytes * (inflight - f * (inflight - resident))
    where `resident` = min(inflight, OFFLOAD_RESIDENT): the microbatch being copied out
    after its forward and the one brought back ahead of its backward stay whole.  The
    solver poses a problem that may offload with f = 1 on every stage
    (`PartitionProblem.resident`), the most offloading can save.  The copies run beside
    the compute (a side stream on CUDA), each way `f * activation_bytes` over the host
    link (`Hardware.host_bandwidth`): the copy out against the forward, the copy back
    against the backward; only what exceeds the compute it runs beside adds to the stage
    (`exposed_s`).  `auto` offloads only where the mesh does not fit otherwise: each
    rank the least fraction that brings it under the memory limit, so the later ranks,
    which hold fewer microbatches in flight, offload less (nothing where they fit).
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..cost.hardware import Hardware
from ..cost.roofline import BACKWARD_FLOP_FACTOR
from ..ir import PartitionProblem, Plan, StagePlan

__all__ = ["POLICIES", "choose", "exposed_s", "offloaded_plan", "saved_bytes"]

POLICIES = ("auto", "none", "all")


def saved_bytes(problem: PartitionProblem, stage: int, activation_bytes: int, fraction: float) -> int:
    """The device bytes stage `stage` saves by offloading `fraction` of its activations."""
    return round(fraction * activation_bytes * (problem.inflight(stage) - _resident(problem, stage)))


def _resident(problem: PartitionProblem, stage: int) -> int:
    """The microbatches stage `stage` holds whole when it offloads all it may."""
    return replace(problem, offload=True).resident(stage)


def exposed_s(activation_bytes: int, fraction: float, forward_s: float, backward_s: float,
              hardware: Hardware) -> tuple[float, float]:
    """What the copy out and the copy back add to a stage's forward and backward: the
    part of each copy longer than the compute beside it ([Note: offloaded activations])."""
    copy = fraction * activation_bytes / hardware.host_bandwidth
    return max(0.0, copy - forward_s), max(0.0, copy - backward_s)


def choose(policy: str, plan: Plan, problem: PartitionProblem, limit: int | None) -> tuple[float, ...]:
    """Each stage's fraction offloaded under `policy` (empty: none): `all` 1 everywhere,
    `auto`, where `problem` was posed with offloading, per rank the least that fits."""
    if policy == "all":
        return (1.0,) * plan.num_stages
    if policy != "auto" or not problem.offload or problem.recompute or limit is None:
        return ()
    spare = [saved_bytes(problem, s.index, s.activation_bytes, 1.0) for s in plan.stages]
    out = [0.0] * plan.num_stages
    for r in range(problem.ranks):
        mine = [s.index for s in plan.stages if plan.rank_of(s.index) == r]
        most = sum(spare[k] for k in mine)  # what offloading all of this rank's saves
        need = sum(plan.stages[k].memory_bytes for k in mine) + most - limit
        share = min(1.0, math.ceil(100 * need / most) / 100) if need > 0 and most > 0 else 0.0
        for k in mine:
            out[k] = share
    return tuple(out) if any(out) else ()


def offloaded_plan(plan: Plan, problem: PartitionProblem, fractions: tuple[float, ...], hardware: Hardware) -> Plan:
    """`plan` with `fractions` offloaded: each stage's memory as [Note: offloaded
    activations] counts it and its time with the copies' exposed part."""
    if not fractions:
        return replace(plan, offload=())
    stages = tuple(_stage(s, problem, f, hardware) for s, f in zip(plan.stages, fractions))
    return replace(plan, stages=stages, offload=fractions)


def _stage(s: StagePlan, problem: PartitionProblem, fraction: float, hardware: Hardware) -> StagePlan:
    held = problem.inflight(s.index)
    device = held - fraction * (held - _resident(problem, s.index))
    resident = problem.resident(s.index)  # what `s.memory_bytes` counts
    memory = s.memory_bytes + round(s.activation_bytes * (device - resident))
    forward = s.compute_s / (1 + BACKWARD_FLOP_FACTOR)
    out, back = exposed_s(s.activation_bytes, fraction, forward, s.compute_s - forward, hardware)
    return replace(s, memory_bytes=memory, time_s=s.time_s + out + back)
