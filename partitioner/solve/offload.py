"""Activation offloading in the plan: how much of each stage's activations goes to the host
(`--offload none | all | auto`), the memory that saves and the time the copies cost.

[Note: offloaded activations]
    A stage that offloads a fraction f of what it saves for backward (runtime/offload.py)
    holds on the device, of the activations of its microbatches in flight,
        activation_bytes * (inflight - f * (inflight - resident))
    where `resident` = min(inflight, OFFLOAD_RESIDENT): the microbatch being copied out
    after its forward and the one brought back ahead of its backward stay whole: the
    copies beside the compute of a GPU profile (`Hardware.copies_overlap`).  Where each
    copy is done inside the compute (the CPU profile) the walk ([Note: the memory walk]
    in predict/memory.py) counts instead what that runtime holds: every microbatch's kept
    part, and the whole of those brought back, from the action `runtime.offload.prefetches`
    names to the end of the backward (or I) that reads them.  Either way the bytes
    offloaded per microbatch are those the runtime chooses to the storage
    (`runtime.offload.share_of` over the storages cost/saved.py knows the stage saves), so
    a share is not a fraction of the bytes.  The solver poses a problem that may
    offload with f = 1 on every stage (`PartitionProblem.resident`, the GPU profile's
    count), the most offloading can save.  The copies run beside the compute (a side
    stream on CUDA), each way `f * activation_bytes` over the host
    link (`Hardware.host_bandwidth`): the copy out against the forward, the copy back
    against the backward; only what exceeds the compute it runs beside adds to the stage
    (`exposed_s`).  `auto` offloads only where the mesh does not fit otherwise: each
    rank the least fraction that brings its peak walked over the schedule ([Note: the
    memory walk]) under the memory limit (driver/offloading.py), so the ranks that hold
    less (the later ranks of 1F1B, with fewer microbatches in flight) offload less
    (nothing where they fit).
"""

from __future__ import annotations

from dataclasses import replace

from ..cost.hardware import Hardware
from ..cost.roofline import BACKWARD_FLOP_FACTOR
from ..ir import PartitionProblem, Plan, StagePlan

__all__ = ["POLICIES", "exposed_s", "offloaded_plan"]

POLICIES = ("auto", "none", "all")


def _resident(problem: PartitionProblem, stage: int) -> int:
    """The microbatches stage `stage` holds whole when it offloads all it may."""
    return replace(problem, offload=True).resident(stage)


def exposed_s(activation_bytes: int, fraction: float, forward_s: float, backward_s: float,
              hardware: Hardware) -> tuple[float, float]:
    """What the copy out and the copy back add to a stage's forward and backward: the
    part of each copy longer than the compute beside it ([Note: offloaded activations])."""
    copy = fraction * activation_bytes / hardware.host_bandwidth
    return max(0.0, copy - forward_s), max(0.0, copy - backward_s)


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
