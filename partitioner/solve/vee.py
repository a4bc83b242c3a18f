"""The V DP: the best contiguous plan of zb-v's 2p stages, where each rank runs two of them.

[Note: V placement] (runtime/schedule.py) puts stages r and 2p-1-r on rank r.  A
contiguous plan cuts the block order at 0 = x_0 < x_1 < ... < x_2p = n, so rank r runs
[x_r, x_r+1) and [x_2p-1-r, x_2p-r): its cost depends on the pair of cuts (x_r, x_2p-r)
and the next pair inward.  The DP walks the pairs from the outside in:

    f[0](0, n) = 0
    f[r + 1](a', b') = min over a < a' < b' < b of max(f[r](a, b), rank r on [a, a') and [b', b))
    rank p-1, the turn of the V, runs [a, x) and [x, b), handing over in memory:
    optimum = min over a < x < b of max(f[p-1](a, b), rank p-1 on [a, x) and [x, b))

A rank's time is the sum of its two runs' times as their stages (`Intervals`): compute,
and the messages they certainly exchange with other ranks (the interval DP's bound,
knowing only a run's own ends, `intervals._modes`).  Its memory is the sum of its runs'
less a parameter both read (held once), which is exact.  So, as for the interval DP, the
optimum is a lower bound of every contiguous plan's slowest rank, and `solve` evaluates
its plan exactly; on a chain (each block feeds the next) a plan that meets the bound is
the optimum of every plan.

The same walk minimises, with every rank within a cap, the ranks' summed excess over the
mean compute and then the bytes they send (`vee_balanced`, the second and third
objectives), or the fullest rank's memory (`vee_memory`, for the error that says what
would fit).  A step looks at every (a, a', b', b): n^4 / 24 at worst, but only runs whose
cost stays within a known plan's slowest rank are looked at, so each of the 2p runs
spans about a 2p-th of the compute and the walk takes well under n^3 per rank.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from ..ir import PartitionProblem
from .intervals import Intervals

__all__ = ["vee_balanced", "vee_memory", "vee_time"]

#: (the outer ranks' two keys; this rank's time, memory and bytes sent) -> the two keys
#: with this rank (inf: not allowed); the walk keeps the least first key, then second
_Keys = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]
_Index = tuple[np.ndarray | int, ...]  # numpy indices into the [a, b] matrices


def vee_time(problem: PartitionProblem, upper_s: float = math.inf) -> tuple[tuple[int, ...] | None, float]:
    """The contiguous plan whose slowest rank is fastest and that fits the memory limit
    (None if none fits), and that least slowest rank: a lower bound of every contiguous
    plan's (the module docstring).  `upper_s`, a known plan's slowest rank, only prunes."""
    limit = problem.memory_limit_bytes

    def keys(f1: np.ndarray, f2: np.ndarray, time: np.ndarray, memory: np.ndarray,
             sent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        fits = memory <= limit if limit is not None else np.isfinite(time)
        return np.where(fits, np.maximum(f1, time), np.inf), np.zeros_like(time)

    return _Walk(problem, upper_s, limit).run(keys, 1e-9 * upper_s if math.isfinite(upper_s) else 0.0)


def vee_balanced(problem: PartitionProblem, cap_s: float) -> tuple[int, ...] | None:
    """Among the contiguous plans whose every rank costs at most `cap_s` (the bound
    `vee_time` returned), the one whose ranks exceed the mean compute the least in sum,
    then send the fewest bytes: the second and third objectives (see `solve`)."""
    limit, cap = problem.memory_limit_bytes, cap_s * (1 + 1e-9)
    mean = sum(problem.block_time_s) / problem.ranks

    def keys(f1: np.ndarray, f2: np.ndarray, time: np.ndarray, memory: np.ndarray,
             sent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ok = (time <= cap) & (memory <= limit if limit is not None else True)
        return np.where(ok, f1 + np.maximum(time - mean, 0.0), np.inf), np.where(ok, f2 + sent, np.inf)

    return _Walk(problem, cap, limit).run(keys, 1e-9 * cap_s)[0]


def vee_memory(problem: PartitionProblem, limit: int | None = None) -> tuple[int, ...] | None:
    """The contiguous plan with the least memory on its fullest rank, among those within
    `limit` (None: any; None when there is none, or more stages than blocks)."""

    def keys(f1: np.ndarray, f2: np.ndarray, time: np.ndarray, memory: np.ndarray,
             sent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        fits = np.isfinite(time) & (memory <= limit if limit is not None else True)
        return np.where(fits, np.maximum(f1, memory), np.inf), np.zeros_like(time)

    return _Walk(problem, math.inf, limit).run(keys, 0.0)[0]


class _Walk:
    """Every run [a, b) as each of the 2p stages, as (n + 1) x (n + 1) matrices indexed
    [a, b] (time inf where it is no run: empty, without compute while every stage can
    have some, over `upper_s`, or alone over the memory `limit`), and the walk."""

    def __init__(self, problem: PartitionProblem, upper_s: float, limit: int | None) -> None:
        self.n, self.p = problem.num_blocks, problem.ranks
        iv, full = Intervals(problem), (0, problem.num_blocks + 1, 0)
        time_s, memory, sent = iv.allowed_time_s(*full, limit), iv.memory(*full), iv.sent_bytes(*full)
        upper = upper_s * (1 + 1e-9)
        self.time = [np.where(t <= upper, t, np.inf).T for t in map(time_s, range(problem.stages))]
        self.memory = [memory(k).T for k in range(problem.stages)]
        self.sent = [sent(k).T for k in range(problem.stages)]
        per = 2 + problem.optimizer_factor  # weights, gradients, optimizer state
        self.shared = [(size * per, iv.holds(blocks, *full).T) for size, blocks in iv.shared]

    def run(self, keys: _Keys, tol: float) -> tuple[tuple[int, ...] | None, float]:
        """The plan of the least keys, and its first key (inf, None: no plan)."""
        n, p = self.n, self.p
        f1, f2 = np.full((n + 1, n + 1), np.inf), np.zeros((n + 1, n + 1))
        f1[0, n] = 0.0
        back: list[np.ndarray] = []  # per step, the (a, b) each (a', b') came from
        for r in range(p - 1):
            f1, f2, came = self._step(r, f1, f2, keys, tol)
            back.append(came)
        best = self._turn(f1, f2, keys, tol)
        if best is None:
            return None, math.inf
        value, (a, x, b) = best
        cuts = [0] * (2 * p + 1)
        cuts[p - 1], cuts[p], cuts[p + 1] = a, x, b
        for r in range(p - 1, 0, -1):
            a, b = back[r - 1][:, a, b]
            cuts[r - 1], cuts[2 * p - r + 1] = a, b
        plan = [0] * n
        for k in range(2 * p):
            plan[cuts[k]:cuts[k + 1]] = [k] * (cuts[k + 1] - cuts[k])
        return tuple(plan), value

    def _step(self, r: int, f1: np.ndarray, f2: np.ndarray, keys: _Keys,
              tol: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rank r's runs [a, a') and [b', b) from each pair (a, b) of the outer ranks'."""
        n, left, right = self.n, r, 2 * self.p - 1 - r
        g1, g2 = np.full((n + 1, n + 1), np.inf), np.full((n + 1, n + 1), np.inf)
        came = np.zeros((2, n + 1, n + 1), dtype=np.int64)
        between = 2 * (self.p - 1 - r)  # the stages left inside need a block each
        for a in np.flatnonzero(np.isfinite(f1).any(axis=1)).tolist():
            bs = np.flatnonzero(np.isfinite(f1[a]))
            a2 = np.flatnonzero(np.isfinite(self.time[left][a]))
            b2 = np.flatnonzero(np.isfinite(self.time[right][:, bs]).any(axis=1))
            if not len(a2) or not len(b2):
                continue
            k1, k2 = keys(f1[a, bs], f2[a, bs], *self._rank(left, right, (a, a2[:, None, None]), (b2[:, None], bs)))
            k1 = np.where(b2[None, :, None] - a2[:, None, None] >= between, k1, np.inf)
            i = _least(k1, k2, tol)  # the best b for each (a', b')
            c1, c2 = np.take_along_axis(k1, i[..., None], 2)[..., 0], np.take_along_axis(k2, i[..., None], 2)[..., 0]
            rows, cols = np.ix_(a2, b2)
            better = np.isfinite(c1) & ((c1 < g1[rows, cols] - tol) | ((c1 <= g1[rows, cols] + tol) & (c2 < g2[rows, cols])))
            g1[rows, cols] = np.where(better, c1, g1[rows, cols])
            g2[rows, cols] = np.where(better, c2, g2[rows, cols])
            came[0][rows, cols] = np.where(better, a, came[0][rows, cols])
            came[1][rows, cols] = np.where(better, bs[i], came[1][rows, cols])
        return g1, g2, came

    def _turn(self, f1: np.ndarray, f2: np.ndarray, keys: _Keys,
              tol: float) -> tuple[float, tuple[int, int, int]] | None:
        """Rank p-1's runs [a, x) and [x, b) (stages p-1 and p) from each pair (a, b): the
        best (first key, (a, x, b)), or None."""
        left, right = self.p - 1, self.p
        best: tuple[float, float, tuple[int, int, int]] | None = None
        for a in np.flatnonzero(np.isfinite(f1).any(axis=1)).tolist():
            bs, xs = np.flatnonzero(np.isfinite(f1[a])), np.flatnonzero(np.isfinite(self.time[left][a]))
            if not len(xs):
                continue
            k1, k2 = keys(f1[a, bs], f2[a, bs], *self._rank(left, right, (a, xs[:, None]), (xs[:, None], bs)))
            i = int(_least(k1.reshape(1, -1), k2.reshape(1, -1), tol)[0])
            c1, c2 = float(k1.flat[i]), float(k2.flat[i])
            if math.isfinite(c1) and (best is None or c1 < best[0] - tol or (c1 <= best[0] + tol and c2 < best[1])):
                x, j = np.unravel_index(i, k1.shape)
                best = (c1, c2, (int(a), int(xs[x]), int(bs[j])))
        return (best[0], best[2]) if best is not None else None

    def _rank(self, left: int, right: int, lix: _Index,
              rix: _Index) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A rank's time, memory and bytes sent over its runs lix (as stage `left`) and rix
        (as stage `right`), numpy indices into the [a, b] matrices that broadcast together."""
        memory = self.memory[left][lix] + self.memory[right][rix]
        for size, holds in self.shared:  # a parameter both runs read is held once
            memory = memory - size * (holds[lix] & holds[rix])
        return (self.time[left][lix] + self.time[right][rix], memory, self.sent[left][lix] + self.sent[right][rix])


def _least(k1: np.ndarray, k2: np.ndarray, tol: float) -> np.ndarray:
    """Along the last axis, the index of the least k1, the least k2 among k1 within `tol`."""
    first = k1.min(axis=-1, keepdims=True)
    return np.argmin(np.where(k1 <= first + tol, k2, np.inf), axis=-1)

