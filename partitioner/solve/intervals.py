"""The interval DP: the best plan whose stages are contiguous runs of the block order.

Blocks are numbered in a topological order, so cutting that order into `stages` runs
[0, b_1), [b_1, b_2), ..., [b_{S-1}, n) always gives a valid plan: every edge goes
forward.  Among those cuts the DP finds the one whose slowest stage is fastest:

    f[0, 0] = 0
    f[k + 1, b] = min over a < b of max(f[k, a], cost of run [a, b) as stage k)
    plan = the cuts behind f[S, n], read back through the argmins

where a run's cost is its stage time under [Note: the cost model] (in `model`), or inf
where its memory exceeds the limit (`dp_time`); `dp_memory` minimises the fullest stage
instead, for the error that says what would fit.  A run's messages depend on the other
runs (one per stage pair, [Note: the cost of a boundary]), so the DP charges a run the
least it can pay: one message each way if it receives anything, one if it sends
anything, each value's bytes once.  That is a lower bound of every contiguous plan's
cost, `dp_time` returns it with the plan, and `solve` evaluates the plan exactly: when
each block feeds the next (a chain) every valid plan is contiguous, and a plan whose
exact cost meets the bound is the optimum; `solve` hands other DAGs (and chains where
it does not meet it) on to CP-SAT, warm-started with this plan.

Where a rank runs several stages (interleaved, zb-v: `PartitionProblem.placement`), a
message between two of them is free, and a run's bound counts only what certainly goes
to another rank whatever the other runs are (`_reach`): the stages between stage k and
the nearest earlier one on its rank, d of them, hold a block each, so what the d blocks
before the run make certainly comes from another rank (everything made before it where
no earlier stage shares its rank); likewise for what the blocks after it read.  With one
stage per rank that is the bound above.

This is the problem PipeDream's optimizer solves with a DP over layers (Narayanan et
al., "PipeDream: Generalized Pipeline Parallelism for DNN Training", SOSP 2019), and that
torchgpipe's `balance.blockpartition` balances with the algorithm of Bárány and Grinberg,
"Block Partitions of Sequences" (arXiv:1308.2452).  Here a run's cost is not a sum over
its blocks (a value crossing the cut costs both sides, a tied parameter is held once), so
`Intervals` computes the sums for every run [a, b) at once, by chunks of b.
"""

from __future__ import annotations

import heapq
import math
from typing import Callable, Sequence

import numpy as np

from ..cost.costmodel import Value, computing_blocks, message_s, per_problem, shared_params, values
from ..ir import PartitionProblem

__all__ = ["Intervals", "dp_balanced", "dp_balanced_policies", "dp_memory", "dp_time", "dp_time_policies"]

#: entries of one column chunk of the interval matrices (bounds the DP's memory)
_CHUNK_ENTRIES = 1 << 21
#: runs [a, b) with a0 <= a <= a1 and b0 <= b <= b1, and what each adds
_Rect = tuple[int, int, int, int, float]
#: how many blocks before and after a run certainly lie on other ranks (`_reach`)
_Reach = tuple[int, int]
#: rows and columns of a chunk's (b, a) matrices
_Window = tuple[slice, slice]
#: the whole chunk
_WHOLE: _Window = (slice(None), slice(None))
#: a sum over each run of a chunk as stage k, in a window of it (the whole by default): the
#: DPs ask for the window of the runs a stage can have (`_bands`), taken there alone; the
#: whole chunk's are kept per kind of stage
_Cost = Callable[..., np.ndarray]


def dp_time(problem: PartitionProblem, upper_s: float = math.inf, cap_s: float = math.inf
            ) -> tuple[tuple[int, ...] | None, float]:
    """The contiguous plan with the fastest slowest stage that fits the memory limit (None
    if none fits), and the lower bound of every contiguous plan's slowest stage it
    minimised (the module docstring).  `upper_s`, the slowest stage of a known plan, only
    prunes; `cap_s`, a stage's compute over which no plan is of use, leaves out the runs
    over it plus the most messages a run is charged: the same plan, or None where the
    optimum computes over it ([Note: a cap on a rank's compute] in solve.py)."""
    return dp_time_policies((problem,), upper_s, cap_s)


def dp_balanced(problem: PartitionProblem, cap_s: float) -> tuple[int, ...] | None:
    """Among the contiguous plans whose every run costs at most `cap_s` (the bound
    `dp_time` returned), the one whose runs exceed the mean compute the least in sum,
    then send the fewest bytes: the second and third objectives (see `solve`)."""
    return dp_balanced_policies((problem,), cap_s)


def dp_time_policies(problems: Sequence[PartitionProblem], upper_s: float = math.inf, cap_s: float = math.inf
                     ) -> tuple[tuple[int, ...] | None, float]:
    """`dp_time` where each run costs the least, over `problems` (one per recomputation
    policy, the same blocks, stages and limit, the first the fastest: no recomputation),
    of its time under the policies whose memory fits ([Note: split and recomputation
    chosen together] in solve/policies.py); `cap_s` as for `dp_time`, each policy's runs
    left out by their own time, which a stage of that policy takes."""
    ivs = _sharing([Intervals(p, upper_s) for p in problems])
    within = _capped(ivs, cap_s)
    plan, slowest = _interval_dp(ivs[0], problems[0].stages, _fastest_fit(ivs))
    return (plan, slowest) if slowest <= within else (None, math.inf)


def _capped(ivs: Sequence["Intervals"], cap_s: float) -> float:
    """Lower the runs' bound of `ivs` (one per policy, sharing their messages) to `cap_s`
    plus the most messages a run is charged, and return that: a run over it computes over
    the cap, and so does a plan whose slowest run is (inf: no cap)."""
    if not math.isfinite(cap_s):
        return math.inf
    within = (cap_s + ivs[0].most_messages_s()) * (1 + 1e-9)
    for iv in ivs:
        iv.upper_s = min(iv.upper_s, within)
    return within


def dp_balanced_policies(problems: Sequence[PartitionProblem], cap_s: float) -> tuple[int, ...] | None:
    """`dp_balanced` with each run's cost the least over `problems` (`dp_time_policies`)."""
    first = problems[0]
    stages, n, cap = first.stages, first.num_blocks, cap_s * (1 + 1e-9)
    ivs = _sharing([Intervals(p, cap) for p in problems])
    iv, fastest = ivs[0], _fastest_fit(ivs)
    mean, tol = sum(first.block_time_s) / stages, 1e-9 * cap_s
    excess = np.full((stages + 1, n + 1), np.inf)
    sent = np.full((stages + 1, n + 1), np.inf)
    excess[0, 0] = sent[0, 0] = 0.0
    arg = np.zeros((stages + 1, n + 1), dtype=np.int64)
    for c0, c1, a0 in iv.chunks():
        cost, run_sent = fastest(c0, c1, a0), iv.sent_bytes(c0, c1, a0)
        for k, (b0, b1, s0, s1) in _bands(stages, n, c0, c1, a0):
            window = (slice(b0 - c0, b1 - c0), slice(s0 - a0, s1 - a0))
            time_s, rows = cost(k, window), np.arange(b1 - b0)
            cand = np.where(time_s <= cap, excess[k, None, s0:s1] + np.maximum(time_s - mean, 0.0), np.inf)
            least = cand.min(axis=1, keepdims=True)
            tied = np.where(np.isfinite(cand) & (cand <= least + tol), sent[k, None, s0:s1] + run_sent(k)[window],
                            np.inf)
            best = np.argmin(tied, axis=1)
            excess[k + 1, b0:b1], sent[k + 1, b0:b1] = cand[rows, best], tied[rows, best]
            arg[k + 1, b0:b1] = best + s0
    return _read_plan(arg, stages, n) if np.isfinite(excess[stages, n]) else None


def _sharing(ivs: list["Intervals"]) -> list["Intervals"]:
    """`ivs` sharing the first one's tables of messages, which depend on the edges and the
    links alone: the same for every policy."""
    first = ivs[0].problem
    for iv in ivs[1:]:
        p = iv.problem
        assert (p.edges, p.comm_alpha_s, p.comm_beta_s_per_byte) == (first.edges, first.comm_alpha_s,
                                                                     first.comm_beta_s_per_byte)
        iv._comm, iv._sent, iv._most = ivs[0]._comm, ivs[0]._sent, ivs[0]._most
    return ivs


def _fastest_fit(ivs: Sequence["Intervals"]) -> Callable[[int, int, int], _Cost]:
    """A chunk's cost of each run as stage k: the least over `ivs` (a problem each) of its
    time where its memory fits that problem's limit, inf where it fits none."""
    def chunk_cost(c0: int, c1: int, a0: int) -> _Cost:
        costs = [iv.allowed_time_s(c0, c1, a0, iv.problem.memory_limit_bytes) for iv in ivs]
        return costs[0] if len(costs) == 1 else \
            lambda k, window=_WHOLE: np.minimum.reduce([c(k, window) for c in costs])
    return chunk_cost


def dp_memory(problem: PartitionProblem) -> tuple[int, ...] | None:
    """The contiguous plan with the least memory on its fullest stage, whatever the limit
    (None only when there are more stages than blocks)."""
    iv = Intervals(problem)
    return _interval_dp(iv, problem.stages, iv.memory)[0]


class Intervals:
    """The cost model's sums over every run [a, b) of the block order, by chunks of b.

    Whether a value is sent or received by a run, or a shared parameter held, is a union
    of rectangles in (b, a); each rectangle goes in as four corners of a 2-D difference
    array, so a chunk of the sums is two cumulative sums away.  Matrices are (b, a):
    row b - c0 for each end b in [c0, c1), column a for each start a < c1.  A run's
    messages depend on its stage's neighbours' ranks (`_reach`): the sums are built per
    kind of stage, when first asked for.
    """

    def __init__(self, problem: PartitionProblem, upper_s: float = math.inf) -> None:
        n, p = problem.num_blocks, problem
        own, self.shared = shared_params(problem)
        self.n, self.problem, self.upper_s = n, problem, upper_s * (1 + 1e-9)
        self.time = np.concatenate([[0.0], np.cumsum(p.block_time_s, dtype=np.float64)])
        self.acts = np.concatenate([[0], np.cumsum(p.block_activation_bytes, dtype=np.int64)])
        self.kept = np.concatenate([[0], np.cumsum(p.block_kept_bytes or [0] * n, dtype=np.int64)])
        self.seeds = np.concatenate([[0], np.cumsum(p.block_seed_bytes or [0] * n, dtype=np.int64)])
        self.own = np.concatenate([[0], np.cumsum(own, dtype=np.int64)])
        links = _links(problem)
        self.reach = links.reach(problem.placement)
        self._comm, self._sent, self._most = links.comm, links.sent, links.most
        received: list[_Rect] = []
        if p.recompute:
            for v in values(problem):
                received += _first_reader_rects(v.producer + 1, v.readers, n, v.bytes)
        computing = np.zeros(n, dtype=np.int64)
        computing[computing_blocks(p)] = 1
        self.computing = np.concatenate([[0], np.cumsum(computing)])
        self.must_compute = int(computing.sum()) >= p.stages  # [Note: every stage computes] in solve.py
        self.held = _corners([r for size, blocks in self.shared for r in _first_reader_rects(0, blocks, n, size)],
                             np.int64)
        self.received = _corners([r for r in received if r[-1]], np.int64)
        self._received: dict[int, tuple[np.ndarray, ...]] = {}  # `_received_corners`, by reach before

    def chunks(self) -> list[tuple[int, int, int]]:
        """(c0, c1, a0): ends b in [c0, c1) and the starts a in [a0, c1) worth a look, those
        whose compute alone stays within `upper_s` (a known plan's slowest stage)."""
        out, c0 = [], 1
        while c0 <= self.n:
            a0 = int(np.searchsorted(self.time, self.time[c0] - self.upper_s)) if math.isfinite(self.upper_s) else 0
            d = c0 - a0
            width = max(1, min(int((math.sqrt(d * d + 4 * _CHUNK_ENTRIES) - d) / 2), max(d, 256)))
            out.append((c0, min(c0 + width, self.n + 1), a0))
            c0 += width
        return out

    def allowed_time_s(self, c0: int, c1: int, a0: int, limit: int | None) -> _Cost:
        """Stage time of each run as stage k, as a function of k (and a window of the
        chunk, `_Cost`); inf where a >= b, where it exceeds the memory limit or holds no
        compute while every stage can have some."""
        b, a = np.arange(c0, c1)[:, None], np.arange(a0, c1)[None, :]
        valid = (a < b) & (self.computing[b] > self.computing[a]) if self.must_compute else a < b
        compute = np.where(valid, self.time[b] - self.time[a], np.inf)
        if math.isfinite(self.upper_s):  # the chunk's starts leave some runs over it
            compute[compute > self.upper_s] = np.inf
        by_reach: dict[_Reach, np.ndarray] = {}

        def time_s(k: int, window: _Window = _WHOLE) -> np.ndarray:
            reach = self.reach[k]
            if reach not in by_reach:
                by_reach[reach] = compute + _sum_corners(self._comm_corners(reach), c0, c1, a0, np.float64)
            return by_reach[reach][window]

        if limit is None:
            return time_s
        memory = self.memory(c0, c1, a0)
        by_kind: dict[tuple[_Reach, int, int], np.ndarray] = {}

        def allowed(k: int, window: _Window = _WHOLE) -> np.ndarray:
            if window is not _WHOLE:
                return np.where(memory(k, window) <= limit, time_s(k, window), np.inf)
            kind = (self.reach[k], self._held(k), self.problem.awaiting_w(k))
            if kind not in by_kind:  # once per kind of stage: many share their reach and counts
                by_kind[kind] = np.where(memory(k) <= limit, time_s(k), np.inf)
            return by_kind[kind]

        return allowed

    def sent_bytes(self, c0: int, c1: int, a0: int) -> Callable[[int], np.ndarray]:
        """The bytes each run certainly sends another rank as stage k (each value once),
        as a function of k."""
        by_reach: dict[int, np.ndarray] = {}

        def sent(k: int) -> np.ndarray:
            after = self.reach[k][1]
            if after not in by_reach:
                if after not in self._sent:
                    self._sent[after] = _corners([r for v in values(self.problem)
                                                  for r in _sent_rects(v, after, float(v.bytes))], np.float64)
                by_reach[after] = _sum_corners(self._sent[after], c0, c1, a0, np.float64)
            return by_reach[after]

        return sent

    def memory(self, c0: int, c1: int, a0: int) -> _Cost:
        """Memory of each run as stage k, as a function of k (and a window of the chunk,
        `_Cost`); inf where a >= b (the memory model of `PartitionProblem`, its messages
        those the run certainly sends and receives, `_reach`)."""
        b, a = np.arange(c0, c1)[:, None], np.arange(a0, c1)[None, :]
        p = self.problem
        held = _sum_corners(self.held, c0, c1, a0, np.int64)
        weights = np.where(a < b, self.own[b] - self.own[a] + held, 0).astype(np.float64)
        fixed = np.where(a < b, weights * (2 + p.optimizer_factor), np.inf)
        after = np.maximum(p.step_bytes, weights * p.buckets)  # after the last backward
        acts = (self.acts[b] - self.acts[a]).astype(np.float64)
        inputs = None
        if p.recompute:  # one microbatch's activations, the inputs (and kept outputs) of those in flight
            inputs = _sum_corners(self.received, c0, c1, a0, np.int64).astype(np.float64)
            inputs += (self.kept[b] - self.kept[a]).astype(np.float64)
        seeds = (self.seeds[b] - self.seeds[a]).astype(np.float64)
        sent = self.sent_bytes(c0, c1, a0)
        received: dict[int, np.ndarray] = {}
        by_count: dict[tuple[int, int, _Reach], np.ndarray] = {}

        def messages_of(k: int) -> np.ndarray:  # certainly sent and received, forward
            before = self.reach[k][0]
            if before not in received:
                received[before] = _sum_corners(self._received_corners(before), c0, c1, a0, np.float64)
            return sent(k) + received[before]

        def of(count: int, awaiting: int, reach: _Reach, k: int, window: _Window) -> np.ndarray:
            f, m = fixed[window], acts[window]
            held = f + m + inputs[window] * count if inputs is not None else f + m * count
            messages = messages_of(k)[window] if p.holds_messages else 0.0
            held = held + p.working_bytes + messages * (p.microbatches + 2)
            held = np.maximum(held, f + messages * p.microbatches + after[window])
            return held + seeds[window] * awaiting if awaiting else held

        def memory(k: int, window: _Window = _WHOLE) -> np.ndarray:
            count, awaiting, reach = self._held(k), self.problem.awaiting_w(k), self.reach[k]
            if window is not _WHOLE:
                return of(count, awaiting, reach, k, window)
            if (count, awaiting, reach) not in by_count:  # once per count of microbatches held, W awaited, reach
                by_count[(count, awaiting, reach)] = of(count, awaiting, reach, k, window)
            return by_count[(count, awaiting, reach)]

        return memory

    def _received_corners(self, before: int) -> tuple[np.ndarray, ...]:
        """The corners of the bytes a run certainly receives from another rank (each value
        once) as a stage with `before` blocks right before it on other ranks (`_reach`)."""
        if before not in self._received:
            self._received[before] = _corners([r for v in values(self.problem)
                                               for r in _received_rects(v, before, self.n, float(v.bytes))], np.float64)
        return self._received[before]

    def _held(self, k: int) -> int:
        """The microbatches whose activations `memory` charges stage k for: under
        recomputation the inputs of those in flight, else all of those resident
        (`inflight`, or fewer offloading)."""
        return self.problem.inflight(k) if self.problem.recompute else self.problem.resident(k)

    def holds(self, blocks: Sequence[int], c0: int, c1: int, a0: int) -> np.ndarray:
        """Whether each run holds one of `blocks` (sorted): a parameter they read."""
        return _sum_corners(_corners(_first_reader_rects(0, blocks, self.n, 1), np.int64), c0, c1, a0, np.int64) > 0

    def most_messages_s(self) -> float:
        """The most a run is charged for its messages (its time over its compute) as any
        stage, or more: the cells that are no run count too."""
        most = self._most
        for reach in set(self.reach) - most.keys():
            most[reach] = float(_sum_corners(self._comm_corners(reach), 1, self.n + 1, 0, np.float64).max(initial=0.0))
        return max(most[reach] for reach in set(self.reach))

    def _comm_corners(self, reach: _Reach) -> tuple[np.ndarray, ...]:
        """The corners of a run's messages (lower bound, forward and backward) for `reach`."""
        if reach not in self._comm:
            p, n = self.problem, self.n
            rects: list[_Rect] = []
            for v in values(p):
                w = 2 * message_s(0.0, p.comm_beta_s_per_byte, v.bytes)
                rects += _sent_rects(v, reach[1], w) + _received_rects(v, reach[0], n, w)
            rects += _message_rects(p, n, 2 * message_s(p.comm_alpha_s, 0.0, 0), reach)
            self._comm[reach] = _corners([r for r in rects if r[-1]], np.float64)
        return self._comm[reach]


class _Links:
    """What a run's messages cost depends on the edges and the links alone, and on its
    stage's `_reach`: the same for every problem posed from one graph and mesh (each
    variant, each policy, each stage count).  These tables are kept for the last few
    (`_links`), filled as `Intervals` asks: the corners of `_comm_corners` and
    `most_messages_s` by reach, those of `sent_bytes` by the blocks after, and each
    placement's reach of every stage."""

    def __init__(self, problem: PartitionProblem) -> None:
        self.n = problem.num_blocks
        self.span = max((v.readers[-1] - v.producer for v in values(problem)), default=0)  # the longest edge
        self.comm: dict[_Reach, tuple[np.ndarray, ...]] = {}
        self.sent: dict[int, tuple[np.ndarray, ...]] = {}
        self.most: dict[_Reach, float] = {}  # the most messages of any run, by reach
        self._reach: dict[tuple[int, ...], list[_Reach]] = {}

    def reach(self, placed: tuple[int, ...]) -> list[_Reach]:
        """Each stage's `_reach` under `placed` (the rank of each stage)."""
        if placed not in self._reach:
            self._reach[placed] = [_reach(placed, k, self.n, self.span) for k in range(len(placed))]
        return self._reach[placed]


@per_problem("edges", by_value=("num_blocks", "comm_alpha_s", "comm_beta_s_per_byte"), kept=16)
def _links(problem: PartitionProblem) -> _Links:
    """The `_Links` of `problem`'s edges and links, kept for the last few."""
    return _Links(problem)


def _reach(placed: Sequence[int], k: int, n: int, span: int) -> _Reach:
    """How many blocks right before and right after stage k's run certainly lie on other
    ranks, whatever the other runs are: one per stage between k and the nearest earlier
    (later) stage on its rank, each holding a block at least; all `n` where there is none
    or where that reaches as far as any edge (`span` blocks), which is the same."""
    def blocks(between: list[int]) -> int:
        return min(between) if between and min(between) < span else n

    return (blocks([k - j - 1 for j in range(k) if placed[j] == placed[k]]),
            blocks([j - k - 1 for j in range(k + 1, len(placed)) if placed[j] == placed[k]]))


def _sent_rects(v: Value, after: int, w: float) -> list[_Rect]:
    """Runs [a, b) that hold `v`'s producer and certainly send it: a reader in [b, b + after)."""
    rects: list[_Rect] = []
    for r in v.readers:
        lo = max(v.producer + 1, r - after + 1)  # the ends b for which r is within reach
        if lo > r:
            continue
        if rects and lo <= rects[-1][3] + 1:
            rects[-1] = (0, v.producer, rects[-1][2], r, w)
        else:
            rects.append((0, v.producer, lo, r, w))
    return rects


def _received_rects(v: Value, before: int, n: int, w: float) -> list[_Rect]:
    """Runs [a, b) that read `v` and certainly receive it: made in [a - before, a)."""
    top = v.producer + before  # the last start a with the producer within reach
    return [(a0, min(a1, top), b0, b1, w) for a0, a1, b0, b1, w in _first_reader_rects(v.producer + 1, v.readers, n, w)
            if a0 <= top]


def _message_rects(problem: PartitionProblem, n: int, w: float, reach: _Reach) -> list[_Rect]:
    """Runs that certainly receive a message (a value made in [a - before, a) read in [a, b))
    and runs that certainly send one (a value made in [a, b) read in [b, b + after)), `w`
    each (`_reach`): by a sweep over the cut with heaps of the edges open across it (runs
    starting at the cut receive once b passes the first such reader; runs ending at the cut
    send if they hold the last such producer); an edge leaves a heap once past it."""
    if not w:
        return []
    before, after = reach
    made: dict[int, list[tuple[int, int]]] = {}  # edges (producer, reader) by the first cut past the producer
    read: dict[int, list[tuple[int, int]]] = {}  # by the first cut whose reach after it takes in the reader
    for src, dst in sorted({(v.producer, r) for v in values(problem) for r in v.readers}):
        made.setdefault(src + 1, []).append((src, dst))
        read.setdefault(max(src + 1, dst - after + 1), []).append((src, dst))
    rects: list[_Rect] = []
    open_min: list[tuple[int, int]] = []  # (reader, producer) of values made before the cut
    open_max: list[tuple[int, int]] = []  # (-producer, reader) of values made before the cut, read in reach
    for cut in range(1, n):
        for src, dst in made.get(cut, []):
            heapq.heappush(open_min, (dst, src))
        for src, dst in read.get(cut, []):
            heapq.heappush(open_max, (-src, dst))
        while open_min and (open_min[0][0] < cut or open_min[0][1] < cut - before):
            heapq.heappop(open_min)
        if open_min:
            rects.append((cut, cut, open_min[0][0] + 1, n, w))
        while open_max and open_max[0][1] < cut:
            heapq.heappop(open_max)
        if open_max:
            rects.append((0, -open_max[0][0], cut, cut, w))
    return rects


def _first_reader_rects(start: int, readers: Sequence[int], n: int, w: float) -> list[_Rect]:
    """Runs [a, b) with a >= start that contain one of `readers` (sorted): for a in
    (r_{j-1}, r_j], the first reader at or after a is r_j, so b > r_j."""
    rects: list[_Rect] = []
    lo = start
    for r in readers:
        if r >= lo:
            rects.append((lo, r, r + 1, n, w))
            lo = r + 1
    return rects


def _corners(rects: list[_Rect], dtype: type) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(b, a, signed weight) of each corner of the rectangles."""
    if not rects:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, dtype)
    a0, a1, b0, b1 = (np.asarray(c, dtype=np.int64) for c in list(zip(*rects))[:4])
    w: np.ndarray = np.asarray([r[4] for r in rects], dtype=dtype)
    return (np.concatenate([b0, b1 + 1, b0, b1 + 1]), np.concatenate([a0, a0, a1 + 1, a1 + 1]),
            np.concatenate([w, -w, -w, w]))


def _sum_corners(corners: tuple[np.ndarray, ...], c0: int, c1: int, a0: int, dtype: type) -> np.ndarray:
    """For each (b, a) with c0 <= b < c1 and a0 <= a < c1, the sum of corners at or before it."""
    b, a, w = corners
    keep = (b < c1) & (a < c1)
    grid: np.ndarray = np.zeros((c1 - c0, c1 - a0), dtype=dtype)
    np.add.at(grid, (np.maximum(b[keep] - c0, 0), np.maximum(a[keep] - a0, 0)), w[keep])
    np.add.accumulate(grid, axis=0, out=grid)
    return np.add.accumulate(grid, axis=1, out=grid)


def _interval_dp(iv: Intervals, stages: int, chunk_cost: Callable[[int, int, int], _Cost]
                 ) -> tuple[tuple[int, ...] | None, float]:
    """The contiguous plan into `stages` runs that minimises the max over its runs of
    chunk_cost(c0, c1, a0)(stage) (a (b, a) matrix), or None if every plan costs inf,
    and that max.

    f[k, b] is the best such max over the first k stages holding blocks [0, b).
    """
    n = iv.n
    f = np.full((stages + 1, n + 1), np.inf)
    f[0, 0] = 0.0
    arg = np.zeros((stages + 1, n + 1), dtype=np.int64)
    for c0, c1, a0 in iv.chunks():
        cost = chunk_cost(c0, c1, a0)
        for k, (b0, b1, s0, s1) in _bands(stages, n, c0, c1, a0):
            window = (slice(b0 - c0, b1 - c0), slice(s0 - a0, s1 - a0))
            cand = np.maximum(f[k, None, s0:s1], cost(k, window))  # (b, a)
            best = np.argmin(cand, axis=1)
            f[k + 1, b0:b1], arg[k + 1, b0:b1] = cand[np.arange(b1 - b0), best], best + s0
    if not np.isfinite(f[stages, n]):
        return None, math.inf
    return _read_plan(arg, stages, n), float(f[stages, n])


def _bands(stages: int, n: int, c0: int, c1: int, a0: int) -> list[tuple[int, tuple[int, int, int, int]]]:
    """Each stage k's runs [a, b) within a chunk (ends [c0, c1), starts from a0) that can lie
    on a plan's path, as (k, (b0, b1, s0, s1)): ends b0 <= b < b1, starts s0 <= a < s1.
    Every stage holds a block, so stage k starts at k or later and ends leaving a block to
    each stage after it; f[k + 1, b] outside is never read (left inf), and the starts left
    out are inf already (f[k, a] for a < k, or a >= b), so the argmins are the same."""
    out = []
    for k in range(stages):
        b0, b1 = max(c0, k + 1), min(c1, n - stages + k + 2)
        s0, s1 = max(a0, k), b1 - 1
        if b0 < b1 and s0 < s1:
            out.append((k, (b0, b1, s0, s1)))
    return out


def _read_plan(arg: np.ndarray, stages: int, n: int) -> tuple[int, ...]:
    """The plan behind a DP's argmins: arg[k, b] is where the k-th run ending at b starts."""
    assignment, b = [0] * n, n
    for k in range(stages, 0, -1):
        a = int(arg[k, b])
        assignment[a:b] = [k - 1] * (b - a)
        b = a
    return tuple(assignment)
