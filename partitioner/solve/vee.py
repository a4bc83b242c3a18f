"""The V DP: the best contiguous plan of zb-v's 2p stages, where each rank runs two of them.

[Note: V placement] (runtime/schedule/registry.py) puts stages r and 2p-1-r on rank r.  A
contiguous plan cuts the block order at 0 = x_0 < x_1 < ... < x_2p = n, so rank r runs
[x_r, x_r+1) and [x_2p-1-r, x_2p-r): its cost depends on the pair of cuts (x_r, x_2p-r)
and the next pair inward.  The DP walks the pairs from the outside in:

    f[0](0, n) = 0
    f[r + 1](a', b') = min over a < a' < b' < b of max(f[r](a, b), rank r on [a, a') and [b', b))
    rank p-1, the turn of the V, runs [a, x) and [x, b), handing over in memory:
    optimum = min over a < x < b of max(f[p-1](a, b), rank p-1 on [a, x) and [x, b))

A rank's time is the sum of its two runs' times as their stages (`Intervals`): compute,
and the messages they certainly exchange with other ranks (the interval DP's bound,
knowing only a run's own ends, `intervals._reach`).  Its memory is the sum of its runs'
less a parameter both read (held once), which is exact.  So, as for the interval DP, the
optimum is a lower bound of every contiguous plan's slowest rank, and `solve` evaluates
its plan exactly; on a chain (each block feeds the next) a plan that meets the bound is
the optimum of every plan.

The same walk minimises, with every rank within that optimum, the ranks' summed excess
over the mean compute and then the bytes they send (the second and third objectives,
`vee_plans`), or the fullest rank's memory (`vee_memory`, for the error that says what
would fit).  A step looks at every (a, a', b', b): n^4 / 24 at worst, but only at runs
where their stage can lie, whose rank stays within a known plan's slowest rank U, and at
pairs of cuts that leave the ranks inside no more compute than they can take within U
(less the least messages of any of their runs): after r ranks the compute outside the
cuts lies in a band, as narrow as U is close to the mean rank.  A step takes a chunk of
pairs (a, b) at once, each with every a' and b' within its stages' longest runs.
"""

from __future__ import annotations

import copy
import math
from typing import Callable

import numpy as np

from ..ir import PartitionProblem
from .intervals import Intervals

__all__ = ["vee_memory", "vee_plans"]

#: (the outer ranks' keys, this rank's runs) -> the keys with this rank (inf: not allowed;
#: no second key: none); the walk keeps the least first key, then the least second
_Keys = Callable[[np.ndarray, np.ndarray, "_Rank"], tuple[np.ndarray, np.ndarray | None]]
_Index = tuple[np.ndarray | int, ...]  # numpy indices into the [a, b] matrices
#: candidates of one chunk of a step (bounds its memory)
_CHUNK = 1 << 18


def vee_plans(problem: PartitionProblem, upper_s: float = math.inf, cap_s: float = math.inf
              ) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None, float]:
    """The contiguous plan whose slowest rank is fastest and that fits the memory limit
    (None if none fits); among those whose every rank is within that least slowest rank,
    the one whose ranks exceed the mean compute the least in sum, then send the fewest
    bytes (the second and third objectives, see `solve`); and that least slowest rank, a
    lower bound of every contiguous plan's (the module docstring).  `upper_s`, a known
    plan's slowest rank, only prunes; `cap_s`, a rank's compute over which no plan is of
    use, leaves out the ranks whose time exceeds it plus the most messages a rank is
    charged: the same plan, or None where the optimum computes over it ([Note: a cap on a
    rank's compute] in solve.py)."""
    walk = _Walk(problem, upper_s, problem.memory_limit_bytes, cap_s)

    def fastest(f1: np.ndarray, f2: np.ndarray, rank: _Rank) -> tuple[np.ndarray, None]:
        return np.where(rank.fits(), np.maximum(f1, rank.time), np.inf), None

    plan, bound = walk.run(fastest, 1e-9 * upper_s if math.isfinite(upper_s) else 0.0)
    if plan is None:
        return None, None, bound
    cap, mean = bound * (1 + 1e-9), sum(problem.block_time_s) / problem.ranks

    def balanced(f1: np.ndarray, f2: np.ndarray, rank: _Rank) -> tuple[np.ndarray, np.ndarray]:
        ok = (rank.time <= cap) & rank.fits()
        return np.where(ok, f1 + np.maximum(rank.time - mean, 0.0), np.inf), np.where(ok, f2 + rank.sent(), np.inf)

    return plan, walk.within(bound).run(balanced, 1e-9 * bound)[0], bound


def vee_memory(problem: PartitionProblem, limit: int | None = None) -> tuple[int, ...] | None:
    """The contiguous plan with the least memory on its fullest rank, among those within
    `limit` (None: any; None when there is none, or more stages than blocks)."""

    def keys(f1: np.ndarray, f2: np.ndarray, rank: _Rank) -> tuple[np.ndarray, None]:
        memory = rank.memory()
        fits = np.isfinite(rank.time) & (memory <= limit if limit is not None else True)
        return np.where(fits, np.maximum(f1, memory), np.inf), None

    return _Walk(problem, math.inf, limit).run(keys, 0.0)[0]


class _Walk:
    """Every run [a, b) that each of the 2p stages can have, its time and memory
    (`_Banded`: time inf where it is no run: empty, without compute while every stage can
    have some, over `upper_s`, or alone over the memory `limit`), and the walk."""

    def __init__(self, problem: PartitionProblem, upper_s: float, limit: int | None, cap_s: float = math.inf) -> None:
        n, S = problem.num_blocks, problem.stages
        self.n, self.p, self.limit = n, problem.ranks, limit
        iv, full = Intervals(problem), (0, n + 1, 0)
        time_s, memory, sent = iv.allowed_time_s(*full, limit), iv.memory(*full), iv.sent_bytes(*full)
        prefix = np.concatenate([[0.0], np.cumsum(problem.block_time_s, dtype=np.float64)])
        self.inner = prefix[None, :] - prefix[:, None]  # the compute of [a, b), for every pair of cuts
        a, b = _Banded.runs(S, n)
        inner, self.blocks = self.inner[a, b], b - a  # of each stage's runs
        time = _Banded.of(time_s, S, n)
        if math.isfinite(cap_s):  # a rank over the cap plus the most messages of its runs computes over the cap
            most = np.max(time.inside - inner, where=np.isfinite(time.inside), initial=0.0, axis=(1, 2)).tolist()
            upper_s = min(upper_s, cap_s + max(most[r] + most[S - 1 - r] for r in range(self.p)))
        self.upper = upper = upper_s * (1 + 1e-9)
        self.time = time.within(upper)
        # what the ranks inside the cuts after step r can take: U less the least messages of their runs
        least = np.min(self.time.inside - inner, where=np.isfinite(self.time.inside), initial=np.inf,
                       axis=(1, 2)).tolist()
        room = [upper - least[r] - least[2 * self.p - 1 - r] for r in range(self.p)]
        self.room = [sum(room[r + 1:]) for r in range(self.p)]
        self.memory = _Banded.of(memory, S, n)
        self.sent = [sent(k).T for k in range(S)]
        per = 2 + problem.optimizer_factor  # weights, gradients, optimizer state
        self.shared = [(size * per, iv.holds(blocks, *full).T) for size, blocks in iv.shared]
        self._fullest()

    def _fullest(self) -> None:
        """The most memory of any run of each stage (within `upper`), and its most blocks."""
        finite = np.isfinite(self.time.inside)
        self.fullest = np.max(self.memory.inside, where=finite, initial=0.0, axis=(1, 2)).tolist()
        self.longest = np.max(self.blocks, where=finite, initial=0, axis=(1, 2)).tolist()

    def within(self, upper_s: float) -> _Walk:
        """The same walk over the runs within `upper_s` (at most this walk's)."""
        walk = copy.copy(self)
        walk.upper = upper = upper_s * (1 + 1e-9)
        walk.time = self.time.within(upper)
        walk.room = [room - (self.upper - upper) * (self.p - 1 - r) for r, room in enumerate(self.room)]
        walk._fullest()
        return walk

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
        """Rank r's runs [a, a') and [b', b) from each pair (a, b) of the outer ranks': for
        a chunk of pairs at once, every a' and b' within the longest runs of the stages."""
        n, left, right = self.n, r, 2 * self.p - 1 - r
        g1, g2 = np.full((n + 1, n + 1), np.inf), np.zeros((n + 1, n + 1))
        came = np.zeros((2, n + 1, n + 1), dtype=np.int64)
        between = 2 * (self.p - 1 - r)  # the stages left inside need a block each
        a, b = np.nonzero(np.isfinite(f1))
        da, db = np.arange(1, self.longest[left] + 1), np.arange(1, self.longest[right] + 1)  # a' - a, b - b'
        chunk = max(1, _CHUNK // max(1, len(da) * len(db)))
        for c in range(0, len(a) if len(da) and len(db) else 0, chunk):
            ca, cb = a[c:c + chunk, None, None], b[c:c + chunk, None, None]
            a2, b2 = np.minimum(ca + da[:, None], n), np.maximum(cb - db, 0)  # past the ends: runs of no block
            rank = _Rank(self, left, right, (ca, a2), (b2, cb))
            k1, k2 = keys(f1[ca, cb], f2[ca, cb], rank)
            k1 = np.where((b2 - a2 >= between) & (rank.time <= self.upper), k1, np.inf)
            shape = k1.shape
            _merge(g1, g2, came, (a2 * (n + 1) + b2).ravel(), k1.ravel(),
                   None if k2 is None else np.broadcast_to(k2, shape).ravel(),
                   np.broadcast_to(ca, shape).ravel(), np.broadcast_to(cb, shape).ravel(), tol)
        g1[self.inner > self.room[r]] = np.inf  # the ranks inside could not take what is left
        return g1, g2, came

    def _turn(self, f1: np.ndarray, f2: np.ndarray, keys: _Keys,
              tol: float) -> tuple[float, tuple[int, int, int]] | None:
        """Rank p-1's runs [a, x) and [x, b) (stages p-1 and p) from each pair (a, b): the
        best (first key, (a, x, b)), or None."""
        left, right = self.p - 1, self.p
        best: tuple[float, float, tuple[int, int, int]] | None = None
        for a in np.flatnonzero(np.isfinite(f1).any(axis=1)).tolist():
            bs, xs = np.flatnonzero(np.isfinite(f1[a])), self.time.ends(left, a)
            if not len(xs):
                continue
            k1, k2 = keys(f1[a, bs], f2[a, bs], _Rank(self, left, right, (a, xs[:, None]), (xs[:, None], bs)))
            i = int(_least(k1.reshape(1, -1), k2.reshape(1, -1) if k2 is not None else None, tol)[0])
            c1, c2 = float(k1.flat[i]), float(k2.flat[i]) if k2 is not None else 0.0
            if math.isfinite(c1) and (best is None or c1 < best[0] - tol or (c1 <= best[0] + tol and c2 < best[1])):
                x, j = np.unravel_index(i, k1.shape)
                best = (c1, c2, (a, int(xs[x]), int(bs[j])))
        return (best[0], best[2]) if best is not None else None


class _Rank:
    """One rank's runs: lix as stage `left`, rix as stage `right` (numpy indices into the
    [a, b] matrices that broadcast together), and its sums, each taken when asked for."""

    def __init__(self, walk: _Walk, left: int, right: int, lix: _Index, rix: _Index) -> None:
        self.walk, self.left, self.right, self.lix, self.rix = walk, left, right, lix, rix
        self.at = (walk.time.index(left, lix), walk.time.index(right, rix))  # into the walk's `_Banded` tables
        self.time = walk.time.values[self.at[0]] + walk.time.values[self.at[1]]

    def memory(self) -> np.ndarray:
        """The rank's memory: its runs', a parameter both read held once."""
        w, lix, rix = self.walk, self.lix, self.rix
        memory = w.memory.values[self.at[0]] + w.memory.values[self.at[1]]
        for size, holds in w.shared:
            left = holds[lix]
            if left.any():
                memory = memory - size * (left & holds[rix])
        return memory

    def fits(self) -> np.ndarray | bool:
        """Whether the rank's memory is within the limit (True where even its fullest runs fit)."""
        w, limit = self.walk, self.walk.limit
        if limit is None or w.fullest[self.left] + w.fullest[self.right] <= limit:
            return True
        fullest = sum(np.max(w.memory.values[at], where=np.isfinite(w.time.values[at]), initial=0.0) for at in self.at)
        return True if fullest <= limit else self.memory() <= limit

    def sent(self) -> np.ndarray:
        """The bytes the rank certainly sends other ranks (a lower bound, each value once)."""
        return self.walk.sent[self.left][self.lix] + self.walk.sent[self.right][self.rix]


class _Banded:
    """A table of every run [a, b) as each stage, over the runs the stage can have: every
    other stage keeps a block, so stage k's are k <= a < k + w and k < b <= k + w, with w
    = n - S + 1, held at [k, a - k, b - k - 1]; a last row and column of inf stand for
    every run outside (`index`)."""

    def __init__(self, values: np.ndarray) -> None:
        self.values, self.width = values, values.shape[1] - 1
        self.inside = values[:, :-1, :-1]  # the runs of each band

    @staticmethod
    def runs(stages: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The starts a and ends b of each stage's runs, as the bands hold them."""
        width = n - stages + 1
        k, i, j = np.ogrid[:stages, :width, :width]
        return k + i, k + 1 + j

    @classmethod
    def of(cls, cost: Callable[..., np.ndarray], stages: int, n: int) -> _Banded:
        """The bands of `Intervals` sums over the whole (b, a) matrix of n blocks (a `_Cost`): each
        kind's whole sums, once, where the bands cover most of it, else each band's alone."""
        width = n - stages + 1
        values = np.full((stages, width + 1, width + 1), np.inf)
        whole = 2 * width * width >= (n + 1) * (n + 1)
        for k in range(stages):
            window = (slice(k + 1, k + 1 + width), slice(k, k + width))
            values[k, :-1, :-1] = (cost(k)[window] if whole else cost(k, window)).T
        return cls(values)

    def within(self, upper: float) -> _Banded:
        """The same with inf over `upper`."""
        return _Banded(np.where(self.values <= upper, self.values, np.inf))

    def ends(self, k: int, a: int) -> np.ndarray:
        """The ends b of stage k's runs [a, b) that are not inf."""
        i = a - k
        return k + 1 + np.flatnonzero(np.isfinite(self.inside[k, i])) if 0 <= i < self.width else np.zeros(0, np.int64)

    def index(self, k: int, ix: _Index) -> _Index:
        """Where stage k's runs at numpy indices ix = (a, b) are held (the inf row or column
        where outside its band, -1 being the last)."""
        a, b = ix
        return k, np.clip(np.subtract(a, k), -1, self.width), np.clip(np.subtract(b, k + 1), -1, self.width)


def _merge(g1: np.ndarray, g2: np.ndarray, came: np.ndarray, target: np.ndarray, k1: np.ndarray,
           k2: np.ndarray | None, a: np.ndarray, b: np.ndarray, tol: float) -> None:
    """Keep in g1, g2 (and where it came from, the pair (a, b)) the least keys of the
    candidates for each flat index `target`: the least k1, the least k2 of those within
    `tol` of it, the first of those; where they beat what g1, g2 hold."""
    best = np.full(g1.size, np.inf)
    np.minimum.at(best, target, k1)
    near = np.isfinite(k1) & (k1 <= best[target] + tol)
    if k2 is not None:
        second = np.full(g1.size, np.inf)
        np.minimum.at(second, target[near], k2[near])
        near &= k2 <= second[target]
    found = np.flatnonzero(near)
    targets, first = np.unique(target[found], return_index=True)
    pick = found[first]
    c1, c2 = k1[pick], k2[pick] if k2 is not None else np.zeros(len(pick))
    old1, old2 = g1.flat[targets], g2.flat[targets]
    better = (c1 < old1 - tol) | ((c1 <= old1 + tol) & (c2 < old2))
    targets, pick = targets[better], pick[better]
    g1.flat[targets], g2.flat[targets] = c1[better], c2[better]
    came[0].flat[targets], came[1].flat[targets] = a[pick], b[pick]


def _least(k1: np.ndarray, k2: np.ndarray | None, tol: float) -> np.ndarray:
    """Along the last axis, the index of the least k1 (of the least k2 among k1 within `tol`)."""
    if k2 is None:
        return np.argmin(k1, axis=-1)
    first = k1.min(axis=-1, keepdims=True)
    return np.argmin(np.where(k1 <= first + tol, k2, np.inf), axis=-1)
