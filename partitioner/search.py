"""`--devices N`: search the meshes stages x tp x dp = N and the microbatch count.

Every factorisation of N into pipeline stages, tensor-parallel ranks and data-parallel
replicas that the options leave open, with 1, 2 and 4 microbatches per stage, is split
(tensor parallelism, `tp.shard`), posed, solved and simulated; the plan with the best
predicted step time that fits memory is emitted, and the best few are recorded in the
manifest for `show`.  A trace and its costs are reused by every candidate with the same
microbatch shape, and its tensor-parallel split by every candidate with the same tp.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from . import model_file
from .compiler import CompileOptions, Compiled, Prepared, _plan, _problem, apply_tp, finish, model_flops, prepare
from .options import batch_size
from .predict import simulate_plan
from .errors import InfeasiblePlanError, PlanError
from .roofline import BACKWARD_FLOP_FACTOR, mfu
from .solve import solve

__all__ = ["Candidate", "search"]

SHOWN = 5


@dataclass(frozen=True)
class Candidate:
    """One mesh and microbatch count, and what the simulator predicts for it."""

    pp: int
    dp: int
    tp: int
    microbatches: int
    step_time_s: float = float("inf")
    memory_bytes: int = 0
    mfu: float = 0.0
    fits: bool = True
    note: str = ""


def search(opts: CompileOptions, say: Callable[[str], None]) -> Compiled:
    """Compile the best mesh for `opts.devices` devices into `opts.out`."""
    assert opts.devices is not None
    mf = model_file.load(opts.model, opts.entry)
    batch = batch_size(mf, *mf.example_inputs())
    meshes = _meshes(opts.devices, batch, opts)
    if not meshes:
        raise PlanError(f"no mesh stages x tp x dp = {opts.devices} devices suits the options and a batch of {batch} "
                        f"rows: change --devices, or drop --stages/--tp/--dp to let the search choose.")
    say(f"searching {len(meshes)} meshes of {opts.devices} devices (stages x tp x dp, microbatches)")
    whole: dict[int, Prepared] = {}  # microbatch rows -> the traced, costed model (tp = 1)
    split: dict[tuple[int, int], Prepared] = {}  # (rows, tp) -> that model split for tp ranks
    results: list[tuple[Candidate, Any]] = []
    for pp, tp, dp, m in meshes:
        rows = batch // (m * dp)
        sub = dataclasses.replace(opts, devices=None, stages=pp, tp=tp, dp=dp, microbatches=m, quiet=True)
        if rows not in whole:
            whole[rows] = prepare(dataclasses.replace(sub, tp=1))
        if (rows, tp) not in split:
            split[(rows, tp)] = _split(whole[rows], sub, tp)
        if tp > 1 and not split[(rows, tp)].sharded.rules:  # type: ignore[union-attr]
            continue  # the solver split nothing: tp ranks would only repeat each other's work
        prepared = _repose(split[(rows, tp)], sub, pp, m)
        try:
            assignment, report = solve(prepared.problem, time_limit_s=min(opts.time_limit, 5.0))
        except InfeasiblePlanError as exc:
            results.append((Candidate(pp, dp, tp, m, fits=False, note=str(exc).split(":")[0]), None))
            continue
        except PlanError:
            continue
        plan = _plan(prepared.problem, prepared.blocks, assignment, report, sub, pp, prepared.virtual, m)
        sim = simulate_plan(prepared.traced.gm, plan, prepared.costs, prepared.hardware)
        flops = model_flops(prepared) * (1 + BACKWARD_FLOP_FACTOR) * m * dp
        cand = Candidate(pp, dp, tp, m, sim.step_time_s, max(s.memory_bytes for s in plan.stages),
                         mfu(flops, sim.step_time_s, opts.devices, prepared.hardware.peak_flops))
        results.append((cand, (prepared, assignment, report)))
        say(f"  mesh pp={pp} tp={tp} dp={dp} M={m}: {cand.step_time_s * 1e3:.3f} ms, MFU {cand.mfu * 100:.1f}%")
    feasible = sorted((r for r in results if r[0].fits),
                      key=lambda r: (r[0].step_time_s, r[0].tp, r[0].pp, r[0].microbatches))
    if not feasible:
        notes = "; ".join(f"pp={c.pp} tp={c.tp} dp={c.dp} M={c.microbatches}: {c.note}" for c, _ in results[:4])
        raise InfeasiblePlanError(
            f"no mesh of {opts.devices} devices fits --memory ({notes}): raise --memory or add devices."
        )
    best, (prepared, assignment, report) = feasible[0]
    say(f"best mesh: pp={best.pp} tp={best.tp} dp={best.dp}, {best.microbatches} microbatches")
    shown = [dataclasses.asdict(c) for c, _ in feasible[:SHOWN]]
    return finish(prepared, assignment, report, extra={"candidates": shown})


def _meshes(devices: int, batch: int, opts: CompileOptions) -> list[tuple[int, int, int, int]]:
    """(pp, tp, dp, microbatches) to try, in a fixed order: every factorisation of the
    devices that the options leave open, with 1, 2 and 4 microbatches per stage."""
    out = []
    for tp in _divisors(devices):
        if opts.tp is not None and tp != opts.tp:
            continue
        for dp in _divisors(devices // tp):
            if opts.dp != 1 and dp != opts.dp:
                continue
            pp = devices // (tp * dp)
            if opts.stages is not None and pp != opts.stages:
                continue
            counts = [opts.microbatches] if opts.microbatches else sorted({pp, 2 * pp, 4 * pp})
            for m in counts:
                if batch % (m * dp) == 0 and (opts.schedule != "interleaved" or m % pp == 0):
                    out.append((pp, tp, dp, m))
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _split(base: Prepared, opts: CompileOptions, tp: int) -> Prepared:
    """`base` (tp = 1) split for `tp` tensor-parallel ranks."""
    if tp == 1:
        return base
    traced, costs, sharded = apply_tp(base.traced, base.costs, tp, base.hardware, opts)
    return dataclasses.replace(base, opts=opts, traced=traced, costs=costs, sharded=sharded,
                               whole=(base.traced, base.costs))


def _repose(base: Prepared, opts: CompileOptions, pp: int, microbatches: int) -> Prepared:
    """`base` posed for another stage and microbatch count (same trace, same costs)."""
    virtual = opts.virtual_stages if opts.schedule == "interleaved" else 1
    problem, blocks = _problem(base.traced, base.costs, pp * virtual, microbatches, base.hardware, opts, base.sharded)
    return dataclasses.replace(base, opts=opts, problem=problem, blocks=blocks, pp=pp, virtual=virtual,
                               microbatches=microbatches, rows=base.batch // (microbatches * opts.dp))
