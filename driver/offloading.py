"""`--offload`: a fixed mesh solved again with offloading where it does not fit otherwise
(`auto`), each stage's share written into the plan and its prediction ([Note: offloaded
activations] in partitioner/solve/offload.py), and the memory variants (ZeRO-1,
offloading, recomputation) that the mesh search tries."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from partitioner.errors import InfeasiblePlanError
from partitioner.ir import Plan, SolverReport
from partitioner.solve.offload import offloaded_plan

from .memory import rank_peaks, stage_parts
from .options import AUTO, CompileOptions
from .prepared import Prepared
from .recompute import VARIANTS

__all__ = ["fitted", "offload", "offload_block", "offloaded", "solve_offloading", "variants"]

Solve = Callable[..., tuple[tuple[int, ...], SolverReport]]


def solve_offloading(p: Prepared, solve: Solve) -> tuple[tuple[int, ...], SolverReport]:
    """`solve(p.problem)`; under `--offload auto`, where no plan fits, the problem posed
    with offloading (`p.problem` and `p.mesh` then say so) solved instead."""
    retry = p.opts.offload == "auto" and not p.problem.offload and not p.problem.recompute
    try:
        return solve(p.problem, time_limit_s=p.opts.time_limit, explain=not retry)  # the retry's error explains
    except InfeasiblePlanError:
        if not retry:
            raise
    p.say("the mesh does not fit with every activation on the device: activations offloaded to the host where "
          "the memory binds (--offload auto)")
    p.problem, p.mesh = dataclasses.replace(p.problem, offload=True), dataclasses.replace(p.mesh, offload=True)
    return solve(p.problem, time_limit_s=p.opts.time_limit)


def offload(p: Prepared, plan: Plan) -> tuple[Plan, dict[str, Any]]:
    """`plan` with the stages' shares of `--offload`, and the `predicted` entry saying so."""
    out = offloaded(p, plan)
    return out, offload_block(p, plan, out)


def offloaded(p: Prepared, plan: Plan) -> Plan:
    """`plan` with the stages' shares of `--offload` (what the search simulates)."""
    return offloaded_plan(plan, p.problem, _shares(p, plan)[0], p.hardware)


def fitted(p: Prepared, plan: Plan) -> tuple[Plan, list[int]]:
    """`offloaded` and each rank's walked peak under its shares, for the search's check:
    where even every share at 1 leaves a rank over the limit, that is known after one walk,
    not three."""
    shares, peaks = _shares(p, plan, refuse=True)
    out = offloaded_plan(plan, p.problem, shares, p.hardware)
    return out, peaks if peaks is not None else rank_peaks(p, out)


def _shares(p: Prepared, plan: Plan, refuse: bool = False) -> tuple[tuple[float, ...], list[int] | None]:
    """Each stage's fraction offloaded (empty: none), and the ranks' walked peaks under
    them where they were walked on the way (None: not); `refuse`: the fractions at 1
    walked first, and kept where some rank exceeds the limit even so.

    The fractions: `all` 1 everywhere; `auto`, per rank the least that brings its walked
    peak under the limit ([Note: offloaded activations]), so ranks that hold less offload
    less (the solver's own bound may have found the split fitting without offloading
    where the walk, which the manifest reports, does not).  A rank's peak walks its own
    stages alone, so a rank over the limit with all it may offload is over it with any
    share."""
    limit, every = p.problem.memory_limit_bytes, (1.0,) * plan.num_stages
    if p.opts.offload == "all":
        return every, None
    if p.opts.offload != "auto" or limit is None:
        return (), None
    away = rank_peaks(p, dataclasses.replace(plan, offload=every)) if refuse else None
    if away is not None and max(away) > limit:
        return every, away
    keep = rank_peaks(p, dataclasses.replace(plan, offload=()))
    if max(keep) <= limit:
        return (), keep
    away = away or rank_peaks(p, dataclasses.replace(plan, offload=every))
    share = [min(1.0, math.ceil(100 * (k - limit) / (k - a)) / 100) if k > limit and k > a else 0.0
             for k, a in zip(keep, away)]
    out = tuple(share[plan.rank_of(k)] for k in range(plan.num_stages))
    return (out, None) if any(out) else ((), keep)


def offload_block(p: Prepared, before: Plan, after: Plan) -> dict[str, Any]:
    """The manifest's `predicted.offload`: per stage the share offloaded and the device
    bytes it saves of its walked part (nothing when no stage offloads)."""
    if not after.offload:
        return {}
    saved = [a - b for a, b in zip(stage_parts(p, dataclasses.replace(before, offload=())), stage_parts(p, after))]
    return {"offload": [{"stage": s.index, "fraction": f, "saved_bytes": saved[s.index]}
                        for s, f in zip(after.stages, after.offload)]}


def variants(opts: CompileOptions, zeros: tuple[int, ...]) -> list[tuple[int, str | None, bool]]:
    """(ZeRO stage, recomputation policy, offloading) to try, cheapest first: each of `zeros`,
    without then with offloading (--offload auto; only with under all), then (--recompute
    auto) with the split and each stage's policy chosen together (AUTO), then with
    selective, then full recomputation everywhere (only the policy --recompute names, if
    not auto).  `driver.search`
    skips a variant where one that costs no more in any respect fits: ZeRO-1 (its parameter
    broadcast), offloading (the copies) and recomputation (a forward again) each only where
    the mesh does not fit without it; where several alone fit, the simulator decides between
    them ([Note: recomputation chosen per rank] in driver/recompute.py)."""
    recomputes = [p for p in VARIANTS if opts.recompute_policy in (AUTO, p or "none")]
    offloads = {"auto": (False, True), "all": (True,)}.get(opts.offload, (False,))
    return [(z, r, o) for r in recomputes for o in ((False,) if r else offloads) for z in zeros]
