"""Each pipeline rank's walked peak of a plan in the compile's terms ([Note: the memory
walk] in partitioner/predict/memory.py): what the search checks a candidate's fit by, as
the manifest reports it."""

from __future__ import annotations

from codegen.report import format_bytes
from partitioner.errors import InfeasiblePlanError
from partitioner.ir import Plan
from partitioner.predict.memory_terms import plan_memory
from partitioner.trace.buffers import kept_buffers
from runtime.precision import autocast

from .prepared import Prepared

__all__ = ["check_fits", "rank_peaks", "ranks_over", "stage_parts", "undercount"]


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


def ranks_over(p: Prepared, plan: Plan, peaks: list[int] | None = None) -> list[int]:
    """The ranks whose walked peak (`peaks`, walked here when not given) exceeds the
    memory limit."""
    limit = p.problem.memory_limit_bytes
    if limit is None:
        return []
    return [r for r, peak in enumerate(peaks if peaks is not None else rank_peaks(p, plan)) if peak > limit]


def undercount(p: Prepared, plan: Plan, peaks: list[int]) -> int:
    """How much lower the solver's memory bound must go for `plan`'s ranks over the limit
    (0: none is): by what a rank's walked peak exceeds the limit, or where more, by what
    it exceeds the solver's own count of the rank (its stages' `memory_bytes`), which a
    bound lowered by less leaves standing."""
    counted = [0] * plan.pp
    for s in plan.stages:
        counted[plan.rank_of(s.index)] += s.memory_bytes
    limit = p.problem.memory_limit_bytes
    return max((max(peaks[r] - limit, peaks[r] - counted[r]) for r in ranks_over(p, plan, peaks)
                if limit is not None), default=0)


def check_fits(p: Prepared, plan: Plan) -> None:
    """Refuse `plan` where a rank's walked peak, which the manifest reports, exceeds the
    memory limit (--memory, else the device's): the solver's own bound may find a split
    fitting that the walk does not (`compile._fit_by_walk` has solved it again already)."""
    peaks = rank_peaks(p, plan)
    over = ranks_over(p, plan, peaks)
    if not over:
        return
    limit = p.problem.memory_limit_bytes
    assert limit is not None
    given = f"--memory {format_bytes(limit)}" if p.opts.memory is not None else \
        f"the {p.hardware.name} device's memory ({format_bytes(limit)})"
    ranks = ", ".join(f"rank {r} {format_bytes(peaks[r])}" for r in over)
    raise InfeasiblePlanError(
        f"no plan found for pp={plan.pp} fits {given} by the peak each rank holds over its schedule ({ranks}): "
        f"give more memory, more stages (--stages), recomputation (--recompute auto) or offloading (--offload "
        f"auto), or let --devices N choose the mesh.")
