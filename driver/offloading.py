"""`--offload`: a fixed mesh solved again with offloading where it does not fit otherwise
(`auto`), each stage's share written into the plan and its prediction ([Note: offloaded
activations] in partitioner/solve/offload.py), and the memory variants (ZeRO-1,
offloading, recomputation) that the mesh search tries."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from partitioner.errors import InfeasiblePlanError
from partitioner.ir import PartitionProblem, Plan, SolverReport
from partitioner.solve.offload import choose, offloaded_plan, saved_bytes

from .options import AUTO, CompileOptions
from .prepared import Prepared
from .recompute import LEVELS

__all__ = ["offload", "offload_block", "solve_offloading", "variants"]

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
    shares = choose(p.opts.offload, plan, p.problem, p.problem.memory_limit_bytes)
    out = offloaded_plan(plan, p.problem, shares, p.hardware)
    return out, offload_block(out, p.problem)


def offload_block(plan: Plan, problem: PartitionProblem) -> dict[str, Any]:
    """The manifest's `predicted.offload`: per stage the share offloaded and the device
    bytes it saves (nothing when no stage offloads)."""
    if not plan.offload:
        return {}
    return {"offload": [{"stage": s.index, "fraction": f, "saved_bytes": saved_bytes(problem, s.index, s.activation_bytes, f)}
                        for s, f in zip(plan.stages, plan.offload)]}


def variants(opts: CompileOptions, zeros: tuple[int, ...]) -> list[tuple[int, str | None, bool]]:
    """(ZeRO stage, recomputation policy, offloading) to try, cheapest first: each of `zeros`,
    without then with offloading (--offload auto; only with under all), then with selective,
    then full recomputation (only the policy --recompute names, if not auto).  `driver.search`
    skips a variant where one that costs no more in any respect fits: ZeRO-1 (its parameter
    broadcast), offloading (the copies) and recomputation (a forward again) each only where
    the mesh does not fit without it; where several alone fit, the simulator decides between
    them ([Note: recomputation chosen per rank] in driver/recompute.py)."""
    recomputes = [p for p in LEVELS if opts.recompute_policy in (AUTO, p or "none")]
    offloads = {"auto": (False, True), "all": (True,)}.get(opts.offload, (False,))
    return [(z, r, o) for r in recomputes for o in ((False,) if r else offloads) for z in zeros]
