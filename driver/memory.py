"""Each pipeline rank's walked peak of a plan in the compile's terms ([Note: the memory
walk] in partitioner/predict/memory.py): what the search checks a candidate's fit by, as
the manifest reports it."""

from __future__ import annotations

from partitioner.ir import Plan
from partitioner.predict.memory_terms import plan_memory
from partitioner.trace.buffers import kept_buffers
from runtime.precision import autocast

from .prepared import Prepared

__all__ = ["rank_peaks", "stage_parts"]


def stage_parts(p: Prepared, plan: Plan) -> list[int]:
    """Each stage's part of its rank's walked peak, counted under the compile's autocast,
    as the manifest's `memory_bytes` are."""
    with autocast(p.opts.precision, p.timer.device.type), kept_buffers(p.model):
        return plan_memory(p.traced.gm, plan, p.costs, p.loss, p.problem.optimizer_factor, p.values,
                           p.hardware.copies_overlap)


def rank_peaks(p: Prepared, plan: Plan) -> list[int]:
    """The walked peak of each pipeline rank of `plan` (its stages' parts summed)."""
    peaks = [0] * plan.pp
    for k, part in enumerate(stage_parts(p, plan)):
        peaks[plan.rank_of(k)] += part
    return peaks
