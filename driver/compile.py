"""The compile: one model file through the planner's phases into a package.

    python -m partitioner compile MODEL.py --out DIR     driver/cli.py parses the options,
        -> compile_model(CompileOptions)                 this module sequences the phases,
        -> DIR/stage_<k>.py, manifest.json, plan.txt     written by codegen.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Callable

from codegen.report import format_bytes
from partitioner.errors import InfeasiblePlanError
from partitioner.ir import SolverReport
from partitioner.solve.model import interleaved

from .memory import rank_peaks, undercount
from .offloading import offloaded
from .options import AUTO, CompileOptions, fixed_tp
from .phases import finish, prepare, solve_interleaved, solve_problem
from .prepared import Compiled, Prepared, Source
from .recompute import WALK_ROUNDS, planned, solve_cheapest_policy
from .search import search

__all__ = ["compile_model"]

_Solved = tuple[Prepared, tuple[int, ...], SolverReport]


def compile_model(opts: CompileOptions, log: Callable[[str], None] | None = None,
                  source: Source | None = None) -> Compiled:
    """Compile `opts.model` into the package `opts.out`, in seven phases, each a call into one
    package, in the order the data flows:

        1. load     the model file: the model built, its example batch    partitioner.trace.model_file
        2. trace    the fx graph, specialised to one microbatch's shapes   partitioner.trace
        3. cost     every node's time, FLOPs and bytes                     partitioner.cost
        4. tp       the graph one tensor-parallel rank runs (--tp > 1)     partitioner.tp
        5. solve    blocks posed as a problem for the mesh, then staged    partitioner.solve
        6. predict  the step simulated: the manifest's `predicted`         partitioner.predict
        7. emit     the package's files                                    codegen

    With `--devices` and the mesh left open, `driver.search` runs phases 1-5 once per
    candidate mesh, and 6-7 for the best.  `source`: phase 1 already done (`load_source`).
    """
    say = log or (lambda msg: None if opts.quiet else print(msg, file=sys.stderr))
    if opts.devices is not None and (opts.stages is None or opts.tp is None or opts.microbatches is None
                                     or opts.schedule == AUTO or opts.zero is None):
        return search(dataclasses.replace(opts, recompute=opts.recompute_policy), say, source)  # kept by each mesh's options
    opts = fixed_tp(opts)
    prepared = prepare(opts, say, source)  # 1. load, 2. trace, 3. cost, 4. tp, and the problem of 5 posed
    if opts.recompute_policy == AUTO:  # 5. solve, recomputing only where memory binds
        # [Note: recomputation chosen per rank]
        prepared, assignment, report = _fit_by_walk(prepared, lambda p: solve_cheapest_policy(p, _solve))
    else:
        prepared, assignment, report = _fit_by_walk(prepared, _solve)  # 5. solve
    compiled = finish(prepared, assignment, report)  # 6. predict, 7. emit
    say(f"wrote {opts.out}: {prepared.problem.stages} stages; {report.method}, gap {report.gap * 100:.1f}% against the cost model, "
        f"solver {report.wall_s:.2f} s, total {sum(compiled.timings.values()):.2f} s")
    return compiled


def _solve(prepared: Prepared) -> tuple[Prepared, tuple[int, ...], SolverReport]:
    """Phase 5: each stage count per rank where the schedule interleaves ([Note: splits
    chosen by the simulator]), else the one problem posed."""
    if interleaved(prepared.problem):
        return solve_interleaved(prepared, solve_problem)
    return (prepared, *solve_problem(prepared))


def _fit_by_walk(prepared: Prepared, solve_one: Callable[[Prepared], _Solved]) -> _Solved:
    """`solve_one(prepared)`, solved again with the solver's memory limit lowered where a
    rank's peak walked over the schedule (with its offloading) exceeds the limit
    (`memory.undercount`), up to WALK_ROUNDS times: the solver bounds a stage's memory by its terms, the walk, which
    the manifest reports, follows what the runtime holds, and the two may differ
    ([Note: the memory walk] in partitioner/predict/memory.py).  The Prepared returned
    keeps the limit given; `phases.finish` refuses a plan that still exceeds it."""
    limit = prepared.problem.memory_limit_bytes
    solved = solve_one(prepared)
    lowered = limit
    for _ in range(WALK_ROUNDS):
        p = _with_limit(solved[0], limit)
        plan = offloaded(p, planned(p, *solved[1:]))
        lower = undercount(p, plan, rank_peaks(p, plan))
        if lower <= 0:
            break
        assert lowered is not None
        lowered -= lower
        p.say(f"a rank's peak walked over its schedule exceeds the memory limit: solving again with the solver's "
              f"bound {format_bytes(lower)} lower")
        try:
            solved = solve_one(_with_limit(prepared, lowered))
        except InfeasiblePlanError:
            break
    return (_with_limit(solved[0], limit), *solved[1:])  # type: ignore[return-value]


def _with_limit(p: Prepared, limit: int | None) -> Prepared:
    return dataclasses.replace(p, problem=dataclasses.replace(p.problem, memory_limit_bytes=limit))
