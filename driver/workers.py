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

    Posing every candidate (tracing and costing each microbatch shape, splitting it for
    each tp degree) takes one core: 15-21 s on Megatron-LM's largest rows.  So once the
    first shape is posed (there, one row per microbatch: most of the candidates, and
    mostly the best), one worker (`Early`) is forked to solve its candidates in their
    order while the rest are posed; the pool forked after posing takes every candidate in
    the search's order.  Each of the first shape's candidates is solved once, by whichever
    worker claims it first (a flag per candidate in shared memory, set under its lock),
    and the early worker claims no more once the pool starts; all share the best step.
    On Megatron-LM's rows of 1536 and 2520 GPUs it runs 12-17 s and solves 76 and 253
    candidates, though the parent's posing runs slower beside it (docs/planning-at-scale.md).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch

from .prepared import Prepared
from .ranking import Beaten, Candidate, Ranking, Solved, simulate_fastest

__all__ = ["PARALLEL_FROM", "Early", "Outcome", "Solve", "outcomes", "workers"]

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

#: (base, solve) of each candidate, the shared best step, and the claims of the early
#: worker's candidates (`Early`; with `local`, each candidate's index among them, -1 for
#: none, or None in the early worker itself, which stops once `posed`): set in the parent
#: before the workers fork, which inherit it
_JOB: dict[str, Any] = {}


def workers(candidates: int) -> int:
    """The worker processes for a search of `candidates`: one per core this process may run
    on, at most MOST_WORKERS; 1 (no workers) for a small search, one core or no fork."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if candidates < PARALLEL_FROM or "fork" not in multiprocessing.get_all_start_methods():
        return 1
    return max(1, min(cores, MOST_WORKERS))


def outcomes(bases: Sequence[Prepared], solve: Solve, ranking: Ranking, count: int,
             early: Early | None = None) -> Iterator[Outcome]:
    """Each candidate's Outcome, in `count` workers as they finish, or here in order (1):
    `solve(index, beaten)` is the search's own step for candidate `index` (None: skipped by
    its floor; a Candidate: fits nowhere; else its solved splits), `bases[index]` its base
    Prepared; `early`, a worker already solving some of them (placed among these).  What
    is simulated here goes into `ranking` at once; a worker's, returned."""
    if count == 1:
        assert early is None
        yield from (_here(index, solve(index, ranking.beaten), ranking) for index in range(len(bases)))
        return
    ctx = multiprocessing.get_context("fork")
    best = early.best if early is not None else ctx.Value("d", ranking.best_s())
    _JOB.update(bases=bases, solve=solve, best=best, devices=ranking.devices,
                claims=early.claims if early is not None else None, local=early.local if early is not None else None)
    try:
        with ctx.Pool(count, initializer=_one_thread) as pool:
            for outcome in _merged(pool.imap_unordered(_work, range(len(bases)), chunksize=1), early):
                base = bases[outcome.order]
                yield outcome._replace(simulated=[(c, _restore(s, base)) for c, s in outcome.simulated])
    finally:
        _JOB.clear()


def _merged(pool: Iterator[Outcome | None], early: Early | None) -> Iterator[Outcome]:
    """The pool's outcomes and the early worker's as they come, less those claimed by the other."""
    for outcome in pool:
        if early is not None:
            yield from early.ready(wait=False)
        if outcome is not None:
            yield outcome
    if early is not None:
        yield from early.ready(wait=True)


class Early:
    """One worker forked to solve the first candidates posed (`bases`, in the order given,
    by `solve`) while the search poses the rest ([Note: the search in worker processes]);
    `place` says where they stand among all, and `outcomes` takes its Outcomes with the pool's."""

    def __init__(self, bases: Sequence[Prepared], solve: Solve, ranking: Ranking) -> None:
        ctx = multiprocessing.get_context("fork")
        self.size, self.done = len(bases), False
        self.best = ctx.Value("d", ranking.best_s())
        self.claims = ctx.Array("b", len(bases))  # 1: taken by a worker
        self.posed = ctx.Value("b", 0, lock=False)  # 1: every candidate is posed (`place`)
        self.local: list[int] = []  # each candidate's index among these, -1 for none (`place`)
        self._global: list[int] = []
        _JOB.update(bases=bases, solve=solve, best=self.best, devices=ranking.devices, claims=self.claims, local=None,
                    posed=self.posed)
        try:
            self.pool = ctx.Pool(1, initializer=_one_thread)  # the worker forks here, with _JOB as it is
        finally:
            _JOB.clear()
        self.results = self.pool.imap_unordered(_work, range(len(bases)), chunksize=1)

    def place(self, local: list[int]) -> None:
        """Each of the search's candidates' index among the early ones (-1: not one), once
        every candidate is posed: the worker takes no more of them."""
        self.posed.value = 1
        self.local = local
        self._global = [0] * self.size
        for index, i in enumerate(local):
            if i >= 0:
                self._global[i] = index

    def ready(self, wait: bool) -> Iterator[Outcome]:
        """Its Outcomes finished so far, or (`wait`) all of them, numbered as the search's
        candidates (what they simulated still stripped: `outcomes` restores it)."""
        while not self.done:
            try:
                outcome = self.results.next(timeout=None if wait else 0)
            except multiprocessing.TimeoutError:
                return
            except StopIteration:
                self.done = True
                return
            if outcome is not None:
                yield outcome._replace(order=self._global[outcome.order])

    def close(self) -> None:
        """Stop the worker (done, or the search failed)."""
        self.pool.terminate()


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


def _mine(index: int) -> bool:
    """In a worker: whether candidate `index` is this one's to solve.  Each of the early
    worker's candidates is the first worker's to claim it, and the early worker claims
    none once the search has posed every candidate (the pool then has the cores)."""
    claims, local = _JOB["claims"], _JOB["local"]
    if claims is None:
        return True
    if local is None and _JOB["posed"].value:  # the early worker, after posing
        return False
    i = index if local is None else local[index]
    if i < 0:
        return True
    with claims.get_lock():
        taken, claims[i] = claims[i], 1
    return not taken


def _work(index: int) -> Outcome | None:
    """In a worker: candidate `index` solved, and each split that may be the fastest
    simulated; None where it is not this worker's (`_mine`)."""
    if not _mine(index):
        return None
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
