"""The `--devices` search's candidates solved, walked and simulated in worker processes.

[Note: the search in worker processes]
    Where the machine has several cores and the search many candidates (`PARALLEL_FROM`),
    the candidates are handed, in the search's order, to forked worker processes, one per
    core: each solves its candidate's variants, walks their peaks and simulates those that
    may be the fastest, as the search does in one process.  The best step found so far is
    shared (a double in shared memory, lowered under its lock), so every worker prunes by
    the best any of them has found ([Note: the search's bounds] in driver/search.py).  A
    worker sends back what it simulated with its Prepared stripped of what the candidate's
    base already holds (the trace, the costs, the model: `_strip`), which the parent puts
    back.  Each worker computes on one thread (`_one_thread`: the memory walk runs some ops
    to see what autograd saves, and OpenMP's threads do not survive a fork).  Pruning only
    against the best, the winner is the one the search finds in one process; which
    others get simulated, and so listed by `show`, may differ.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch

from .prepared import Prepared
from .ranking import Beaten, Candidate, Ranking, Solved, simulate_fastest

__all__ = ["PARALLEL_FROM", "Outcome", "Solve", "outcomes", "workers"]

#: the fewest candidates worth the workers' start (a small search runs in one process)
PARALLEL_FROM = 64
#: the most worker processes
MOST_WORKERS = 8

#: a field of a Prepared that is its base's own object (`_strip`)
_SAME = "<the base's>"


class Outcome(NamedTuple):
    """What one candidate came to: the candidates simulated, with what each was solved into;
    or the Candidate that fits nowhere; and how many of its splits a bound skipped."""

    order: int  # the candidate's, in the search's order
    simulated: list[tuple[Candidate, Solved]]
    failed: Candidate | None
    skipped: int


#: the search's step for one candidate (`outcomes`)
Solve = Callable[[int, Beaten], "list[Solved] | Candidate | None"]

#: (base, solve) of each candidate, and the shared best step: set in the parent before the
#: workers fork, which inherit it
_JOB: dict[str, Any] = {}


def workers(candidates: int) -> int:
    """The worker processes for a search of `candidates`: one per core this process may run
    on, at most MOST_WORKERS; 1 (no workers) for a small search, one core or no fork."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if candidates < PARALLEL_FROM or "fork" not in multiprocessing.get_all_start_methods():
        return 1
    return max(1, min(cores, MOST_WORKERS))


def outcomes(bases: Sequence[Prepared], solve: Solve, ranking: Ranking, count: int) -> Iterator[Outcome]:
    """Each candidate's Outcome, in `count` workers as they finish, or here in order (1):
    `solve(index, beaten)` is the search's own step for candidate `index` (None: skipped by
    its floor; a Candidate: fits nowhere; else its solved splits), `bases[index]` its base
    Prepared.  What is simulated here goes into `ranking` at once; a worker's, returned."""
    if count == 1:
        yield from (_here(index, solve(index, ranking.beaten), ranking) for index in range(len(bases)))
        return
    ctx = multiprocessing.get_context("fork")
    best = ctx.Value("d", ranking.ranked[0][0].step_time_s if ranking.ranked else math.inf)
    _JOB.update(bases=bases, solve=solve, best=best, devices=ranking.devices)
    try:
        with ctx.Pool(count, initializer=_one_thread) as pool:
            for outcome in pool.imap_unordered(_work, range(len(bases)), chunksize=1):
                base = bases[outcome.order]
                yield outcome._replace(simulated=[(c, _restore(s, base)) for c, s in outcome.simulated])
    finally:
        _JOB.clear()


def _one_thread() -> None:
    """A worker computes on one thread: it has a core of its own, and the parent's OpenMP
    threads do not survive the fork (an op that waited for them would never return)."""
    torch.set_num_threads(1)


def _here(index: int, found: list[Solved] | Candidate | None, ranking: Ranking) -> Outcome:
    """Candidate `index`'s Outcome in this process, what it simulated already in `ranking`."""
    if not isinstance(found, list):
        return _unsolved(index, found)
    skipped = simulate_fastest(found, ranking.beaten, ranking.devices, lambda c, s: ranking.insert(c, s, index))
    return Outcome(index, [], None, skipped)


def _unsolved(index: int, found: Candidate | None) -> Outcome:
    """The Outcome of a candidate skipped by its floor (None) or that fits nowhere."""
    return Outcome(index, [], found, int(found is None))


def _work(index: int) -> Outcome:
    """In a worker: candidate `index` solved, and each split that may be the fastest simulated."""
    best = _JOB["best"]
    beaten = Beaten(lambda: best.value)
    found = _JOB["solve"](index, beaten)
    if not isinstance(found, list):
        return _unsolved(index, found)
    out: list[tuple[Candidate, Solved]] = []

    def keep(cand: Candidate, item: Solved) -> None:
        with best.get_lock():
            best.value = min(best.value, cand.step_time_s)
        out.append((cand, _strip(item, _JOB["bases"][index])))

    skipped = simulate_fastest(found, beaten, _JOB["devices"], keep)
    return Outcome(index, out, None, skipped)


def _strip(item: Solved, base: Prepared) -> Solved:
    """`item` with the fields of its Prepared that are `base`'s own objects left out."""
    fields = {f.name: _SAME if getattr(item.prepared, f.name) is getattr(base, f.name) else getattr(item.prepared, f.name)
              for f in dataclasses.fields(Prepared)}
    return dataclasses.replace(item, prepared=fields, inputs=None)  # type: ignore[arg-type]


def _restore(item: Solved, base: Prepared) -> Solved:
    """`item` as it was in the worker: the fields `_strip` left out taken from `base`."""
    fields: dict[str, Any] = item.prepared  # type: ignore[assignment]
    prepared = Prepared(**{k: getattr(base, k) if isinstance(v, str) and v == _SAME else v for k, v in fields.items()})
    return dataclasses.replace(item, prepared=prepared)
