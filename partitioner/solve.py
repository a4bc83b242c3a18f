"""Assign the blocks of a `PartitionProblem` to pipeline stages (the only ortools import).

[Note: the cost model]
    `stage_costs` is the one definition of the model of the `PartitionProblem` docstring;
    `evaluate`, `objective`, the interval DP, the CP-SAT model and the tests follow it.
    A value is a (producer block, name) pair: a stage receives once each value that its
    blocks read from earlier stages, and sends once each value it makes that a later
    stage reads; both count twice (activation forward, gradient backward).  A parameter
    that several blocks read (tied) is held once per stage.  The last block holds the
    graph's output (`coarsen` puts it there) and lies in the last stage.

Two steps (torchgpipe's `blockpartition` and PipeDream solve the first alone):
    1. An exact DP over contiguous runs of the block order.  Every such plan is valid;
       when each block feeds the next (a chain) every valid plan is one, and the DP is
       the optimum.
    2. Otherwise CP-SAT on the general DAG, warm-started with the DP plan, which it
       replaces only if strictly better; its proved bound is reported.  Deterministic:
       deterministic time limit, fixed seed, interleaved search.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence, TypeVar

import numpy as np
from ortools.sat.python import cp_model

from .errors import InfeasiblePlanError, PlanError
from .ir import PartitionProblem, SolverReport

__all__ = ["CpResult", "StageCost", "evaluate", "objective", "solve", "solve_cpsat", "stage_costs", "violations"]

#: CP-SAT works in integer units: the upper bound on the slowest stage becomes this many.
_UNITS = 1e9
#: entries of one column chunk of the interval matrices (bounds the DP's memory)
_CHUNK_ENTRIES = 1 << 21
#: a CP-SAT plan replaces the DP plan only if better by more than this fraction
_BETTER = 1e-12
#: runs [a, b) with a0 <= a <= a1 and b0 <= b <= b1, and what each adds
_Rect = tuple[int, int, int, int, float]
_T = TypeVar("_T")


# -- the cost model ([Note: the cost model]) ----------------------------------------------


@dataclass(frozen=True)
class StageCost:
    """One stage's terms of the cost model; traffic counts forward and backward."""

    compute_s: float
    messages: int
    traffic_bytes: int
    weight_bytes: int
    activation_bytes: int
    inflight: int
    time_s: float
    memory_bytes: int


@dataclass(frozen=True)
class _Value:
    producer: int
    readers: tuple[int, ...]  # sorted, all > producer in a topological order
    bytes: int


def _per_problem(fn: Callable[[PartitionProblem], _T]) -> Callable[[PartitionProblem], _T]:
    """Cache fn(problem) for the last few problems by identity (hashing one is slow)."""
    cache: dict[int, tuple[PartitionProblem, _T]] = {}

    def cached(problem: PartitionProblem) -> _T:
        hit = cache.get(id(problem))
        if hit is None or hit[0] is not problem:
            if len(cache) >= 4:
                cache.pop(next(iter(cache)))
            hit = cache[id(problem)] = (problem, fn(problem))
        return hit[1]

    return functools.wraps(fn)(cached)


@_per_problem
def _values(problem: PartitionProblem) -> tuple[_Value, ...]:
    """The distinct values that cross blocks, keyed by (producer, name), in edge order."""
    readers: dict[tuple[int, str], set[int]] = {}
    sizes: dict[tuple[int, str], int] = {}
    for e in problem.edges:
        key = (e.src, e.value)
        readers.setdefault(key, set()).add(e.dst)
        sizes[key] = max(sizes.get(key, 0), e.bytes)
    return tuple(_Value(key[0], tuple(sorted(r)), sizes[key]) for key, r in readers.items())


@_per_problem
def _shared_params(problem: PartitionProblem) -> tuple[tuple[int, ...], tuple[tuple[int, tuple[int, ...]], ...]]:
    """(each block's bytes of unshared parameters, [(bytes, blocks)] of each shared one)."""
    size = dict(problem.param_bytes_by_name)
    readers: dict[str, list[int]] = {}
    for block, names in enumerate(problem.block_params):
        for name in dict.fromkeys(names):
            readers.setdefault(name, []).append(block)
    own = list(problem.block_param_bytes)
    shared = []
    for name, blocks in sorted(readers.items()):
        if len(blocks) > 1 and name in size:
            shared.append((size[name], tuple(blocks)))
            for block in blocks:
                own[block] -= size[name]
    return tuple(own), tuple(shared)


def stage_costs(problem: PartitionProblem, assignment: Sequence[int]) -> tuple[StageCost, ...]:
    """Every stage's compute, traffic and memory under `assignment` (a stage per block)."""
    stages = problem.stages
    compute, acts, weights = [0.0] * stages, [0] * stages, [0] * stages
    own, shared = _shared_params(problem)
    for block, k in enumerate(assignment):
        compute[k] += problem.block_time_s[block]
        acts[k] += problem.block_activation_bytes[block]
        weights[k] += own[block]
    for size, blocks in shared:
        for k in {assignment[b] for b in blocks}:
            weights[k] += size
    messages, traffic = [0] * stages, [0] * stages
    for v in _values(problem):
        home = assignment[v.producer]
        later = {assignment[r] for r in v.readers if assignment[r] > home}
        for k in later | ({home} if later else set()):
            messages[k] += 2
            traffic[k] += 2 * v.bytes
    return tuple(
        StageCost(compute[k], messages[k], traffic[k], weights[k], acts[k], problem.inflight(k),
                  compute[k] + problem.comm_alpha_s * messages[k] + problem.comm_beta_s_per_byte * traffic[k],
                  weights[k] * (2 + problem.optimizer_factor) + acts[k] * problem.inflight(k))
        for k in range(stages)
    )


def evaluate(problem: PartitionProblem, assignment: Sequence[int]) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """(time of each stage, memory of each stage) under `assignment`."""
    costs = stage_costs(problem, assignment)
    return tuple(c.time_s for c in costs), tuple(c.memory_bytes for c in costs)


def violations(problem: PartitionProblem, assignment: Sequence[int]) -> list[str]:
    """What makes `assignment` invalid (empty when it is a valid plan)."""
    n, stages = problem.num_blocks, problem.stages
    if len(assignment) != n or any(not 0 <= k < stages for k in assignment):
        return [f"need {n} stages in [0, {stages})"]
    found = [f"edge {e.src}->{e.dst} goes backward" for e in problem.edges if assignment[e.src] > assignment[e.dst]]
    found += [f"stage {k} is empty" for k in sorted(set(range(stages)) - set(assignment))]
    if assignment[-1] != stages - 1:
        found.append("the output block is not in the last stage")
    limit = problem.memory_limit_bytes
    _, memories = evaluate(problem, assignment)
    found += [f"stage {k} needs {m} bytes > {limit}" for k, m in enumerate(memories) if limit is not None and m > limit]
    return found


def objective(problem: PartitionProblem, assignment: Sequence[int]) -> float:
    """The slowest stage's time, or inf when `assignment` is not a valid plan."""
    if violations(problem, assignment):
        return math.inf
    return max(evaluate(problem, assignment)[0])


# -- step 1: the interval DP -------------------------------------------------------------


class _Intervals:
    """The cost model's sums over every run [a, b) of the block order, by chunks of b.

    Whether a value is sent or received by a run, or a shared parameter held, is a union
    of rectangles in (b, a); each rectangle goes in as four corners of a 2-D difference
    array, so a chunk of the sums is two cumulative sums away.  Matrices are (b, a):
    row b - c0 for each end b in [c0, c1), column a for each start a < c1.
    """

    def __init__(self, problem: PartitionProblem, upper_s: float = math.inf) -> None:
        n, p = problem.num_blocks, problem
        own, shared = _shared_params(problem)
        self.n, self.problem, self.upper_s = n, problem, upper_s * (1 + 1e-9)
        self.time = np.concatenate([[0.0], np.cumsum(p.block_time_s, dtype=np.float64)])
        self.acts = np.concatenate([[0], np.cumsum(p.block_activation_bytes, dtype=np.int64)])
        self.own = np.concatenate([[0], np.cumsum(own, dtype=np.int64)])
        comm: list[_Rect] = []
        held: list[_Rect] = []
        for v in _values(problem):
            w = 2 * (p.comm_alpha_s + p.comm_beta_s_per_byte * v.bytes)
            comm.append((0, v.producer, v.producer + 1, v.readers[-1], w))  # sent
            comm += _first_reader_rects(v.producer + 1, v.readers, n, w)  # received
        for size, blocks in shared:
            held += _first_reader_rects(0, blocks, n, size)
        self.comm = _corners([r for r in comm if r[-1]], np.float64)
        self.held = _corners(held, np.int64)

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

    def time_s(self, c0: int, c1: int, a0: int) -> np.ndarray:
        """Stage time of each run; inf where a >= b."""
        b, a = np.arange(c0, c1)[:, None], np.arange(a0, c1)[None, :]
        total = (self.time[b] - self.time[a]) + _sum_corners(self.comm, c0, c1, a0, np.float64)
        return np.where(a < b, total, np.inf)

    def memory(self, c0: int, c1: int, a0: int) -> Callable[[int], np.ndarray]:
        """Memory of each run as stage k, as a function of k; inf where a >= b."""
        b, a = np.arange(c0, c1)[:, None], np.arange(a0, c1)[None, :]
        p = self.problem
        held = _sum_corners(self.held, c0, c1, a0, np.int64)
        fixed = np.where(a < b, (self.own[b] - self.own[a] + held) * (2 + p.optimizer_factor), np.inf)
        acts = (self.acts[b] - self.acts[a]).astype(np.float64)
        return lambda k: fixed + acts * p.inflight(k)


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


def _interval_dp(iv: _Intervals, stages: int,
                 chunk_cost: Callable[[int, int, int], Callable[[int], np.ndarray]]) -> tuple[int, ...] | None:
    """The contiguous plan into `stages` runs that minimises the max over its runs of
    chunk_cost(c0, c1, a0)(stage) (a (b, a) matrix), or None if every plan costs inf.

    f[k, b] is the best such max over the first k stages holding blocks [0, b).
    """
    n = iv.n
    f = np.full((stages + 1, n + 1), np.inf)
    f[0, 0] = 0.0
    arg = np.zeros((stages + 1, n + 1), dtype=np.int64)
    for c0, c1, a0 in iv.chunks():
        cost, rows = chunk_cost(c0, c1, a0), np.arange(c1 - c0)
        for k in range(stages):
            cand = np.maximum(f[k, None, a0:c1], cost(k))  # (b, a)
            best = np.argmin(cand, axis=1)
            f[k + 1, c0:c1], arg[k + 1, c0:c1] = cand[rows, best], best + a0
    if not np.isfinite(f[stages, n]):
        return None
    assignment, b = [0] * n, n
    for k in range(stages, 0, -1):
        a = int(arg[k, b])
        assignment[a:b] = [k - 1] * (b - a)
        b = a
    return tuple(assignment)


def _dp(problem: PartitionProblem, by: str = "time") -> tuple[int, ...] | None:
    """The contiguous plan with the fastest slowest stage that fits the memory limit
    (by="time", None if none fits) or with the least memory on its fullest stage."""
    limit = problem.memory_limit_bytes if by == "time" else None
    iv = _Intervals(problem, _even_split_time(problem) if by == "time" else math.inf)

    def chunk_cost(c0: int, c1: int, a0: int) -> Callable[[int], np.ndarray]:
        memory = iv.memory(c0, c1, a0)
        if by == "memory":
            return memory
        time_s = iv.time_s(c0, c1, a0)
        return (lambda k: time_s) if limit is None else (lambda k: np.where(memory(k) <= limit, time_s, np.inf))

    return _interval_dp(iv, problem.stages, chunk_cost)


def _even_split_time(problem: PartitionProblem) -> float:
    """The slowest stage of the plan that splits compute evenly (inf if it is invalid)."""
    n, stages = problem.num_blocks, problem.stages
    prefix = np.cumsum(problem.block_time_s)
    cuts = [0] + [int(c) + 1 for c in np.searchsorted(prefix, prefix[-1] * np.arange(1, stages) / stages)]
    for j in range(1, stages):  # strictly increasing, leaving a block for every later stage
        cuts[j] = min(max(cuts[j], cuts[j - 1] + 1), n - stages + j)
    plan = [0] * n
    for k, (a, b) in enumerate(zip(cuts, cuts[1:] + [n])):
        plan[a:b] = [k] * (b - a)
    return objective(problem, plan)


def _exact(problem: PartitionProblem) -> bool:
    """Whether every valid plan is contiguous: one stage, or each block feeds the next."""
    linked = {e.src for e in problem.edges if e.dst == e.src + 1}
    return problem.stages == 1 or all(i in linked for i in range(problem.num_blocks - 1))


# -- step 2: CP-SAT over the DAG ---------------------------------------------------------


@dataclass(frozen=True)
class CpResult:
    """What CP-SAT returned: its status, its plan (if any) and the bound it proved."""

    status: str
    assignment: tuple[int, ...] | None
    lower_bound_s: float


class _CpModel:
    """The stage assignment as CP-SAT booleans, in the order encoding.

    ge[i][k] is stage(i) >= k (ge[i][0] is True, ge[i][S] False), so an edge is S-1
    implications; at[i][k] is stage(i) == k.  recv/sent[v][k] say that stage k receives /
    sends value v and held[q][k] that it holds shared parameter q: they are only forced
    up, which minimising the slowest stage never needs more of, so the optimum and the
    proved bound are the cost model's.  Times are integer units rounded down, so a bound
    in units is a bound in seconds.
    """

    def __init__(self, problem: PartitionProblem, scale: float, upper_units: int) -> None:
        self.problem, self.scale, self.model = problem, scale, cp_model.CpModel()
        self.values, (self.own, self.shared) = _values(problem), _shared_params(problem)
        self._add_placement()
        self._add_indicators()
        units = [self._units(t) for t in problem.block_time_s]  # no stage is faster than these
        least = max(max(units), -(-sum(units) // problem.stages))
        self.slowest = self.model.new_int_var(min(least, upper_units), upper_units, "slowest")
        for k in range(problem.stages):
            self.model.add(self.slowest >= self._time(k))
            if problem.memory_limit_bytes is not None:
                self.model.add(self._memory(k) <= problem.memory_limit_bytes)
        self.model.minimize(self.slowest)

    def _add_placement(self) -> None:
        """ge/at, edges forward, the output block last, no stage empty."""
        m, n, S = self.model, self.problem.num_blocks, self.problem.stages
        self.ge = [[True] + [m.new_bool_var(f"ge{i}_{k}") for k in range(1, S)] + [False] for i in range(n)]
        self.at = [[m.new_bool_var(f"at{i}_{k}") for k in range(S)] for i in range(n)]
        for i, k in ((i, k) for i in range(n) for k in range(S)):
            m.add(self.at[i][k] == self.ge[i][k] - self.ge[i][k + 1])
            m.add_implication(self.ge[i][k + 1], self.ge[i][k])
        for src, dst in sorted({(e.src, e.dst) for e in self.problem.edges}):
            for k in range(1, S):
                m.add_implication(self.ge[src][k], self.ge[dst][k])
        m.add_bool_or([self.at[n - 1][S - 1]])
        for k in range(S):
            m.add_bool_or([self.at[i][k] for i in range(n)])

    def _add_indicators(self) -> None:
        """recv/sent of each value and held of each shared parameter, per stage."""
        m, S = self.model, self.problem.stages
        self.recv = [[m.new_bool_var(f"r{j}_{k}") for k in range(S)] for j in range(len(self.values))]
        self.sent = [[m.new_bool_var(f"s{j}_{k}") for k in range(S)] for j in range(len(self.values))]
        for j, v in enumerate(self.values):
            for k, r in ((k, r) for k in range(S) for r in v.readers):
                m.add_bool_or([~self.at[r][k], self.ge[v.producer][k], self.recv[j][k]])
                m.add_bool_or([~self.at[v.producer][k], ~self.ge[r][k + 1], self.sent[j][k]])
        self.held = [[m.new_bool_var(f"q{j}_{k}") for k in range(S)] for j in range(len(self.shared))]
        for j, (_, blocks) in enumerate(self.shared):
            for k, b in ((k, b) for k in range(S) for b in blocks):
                m.add_implication(self.at[b][k], self.held[j][k])

    def _units(self, seconds: float) -> int:
        return int(math.floor(seconds * self.scale))

    def _time(self, k: int) -> cp_model.LinearExprT:
        p = self.problem
        compute = [self._units(t) * self.at[i][k] for i, t in enumerate(p.block_time_s)]
        comm = [self._units(2 * p.comm_alpha_s + 2 * p.comm_beta_s_per_byte * v.bytes) for v in self.values]
        return sum(compute) + sum(c * (self.recv[j][k] + self.sent[j][k]) for j, c in enumerate(comm) if c)

    def _memory(self, k: int) -> cp_model.LinearExprT:
        p = self.problem
        per = 2 + p.optimizer_factor
        blocks = [(per * own + p.inflight(k) * act) * self.at[i][k]
                  for i, (own, act) in enumerate(zip(self.own, p.block_activation_bytes))]
        return sum(blocks) + sum(per * size * self.held[j][k] for j, (size, _) in enumerate(self.shared))

    def hint(self, assignment: Sequence[int]) -> None:
        """Warm-start from `assignment`, auxiliary booleans included."""
        m, S = self.model, self.problem.stages
        for i, s in enumerate(assignment):
            for k in range(S):
                m.add_hint(self.at[i][k], s == k)
                if 0 < k:
                    m.add_hint(self.ge[i][k], s >= k)  # type: ignore[arg-type]  # a variable for 0 < k < S
        for j, v in enumerate(self.values):
            home, later = assignment[v.producer], {assignment[r] for r in v.readers}
            for k in range(S):
                m.add_hint(self.recv[j][k], home < k and k in later)
                m.add_hint(self.sent[j][k], home == k and max(later) > k)
        for j, (_, blocks) in enumerate(self.shared):
            for k in range(S):
                m.add_hint(self.held[j][k], k in {assignment[b] for b in blocks})

    def read(self, solver: cp_model.CpSolver) -> tuple[int, ...]:
        return tuple(sum(int(solver.boolean_value(g)) for g in ge[1:-1]) for ge in self.ge)


def solve_cpsat(problem: PartitionProblem, time_limit_s: float, *, hint: Sequence[int] | None = None,
                upper_bound_s: float | None = None, seed: int = 0, workers: int = 1,
                wall_limit_s: float | None = None) -> CpResult:
    """CP-SAT on the general assignment, within `time_limit_s` of deterministic time (and
    `wall_limit_s` seconds, for benchmarks: a wall-clock limit makes the result vary)."""
    upper = upper_bound_s if upper_bound_s is not None else _worst_time(problem)
    scale = _UNITS / upper if upper > 0 else 1.0
    cp = _CpModel(problem, scale, int(math.ceil(upper * scale)) + 1)
    if hint is not None:
        cp.hint(hint)
    solver = cp_model.CpSolver()
    params = solver.parameters
    params.max_deterministic_time = time_limit_s
    params.random_seed = seed
    params.num_workers = workers
    params.interleave_search = True  # deterministic whatever the workers (and faster here)
    if wall_limit_s is not None:
        params.max_time_in_seconds = wall_limit_s
    status = solver.status_name(solver.solve(cp.model))
    found = status in ("OPTIMAL", "FEASIBLE")
    bound = solver.best_objective_bound / scale if status != "INFEASIBLE" else math.inf
    return CpResult(status, cp.read(solver) if found else None, max(0.0, bound))


def _worst_time(problem: PartitionProblem) -> float:
    """A stage time no plan exceeds: all compute and every value sent and received."""
    per_value = [2 * problem.comm_alpha_s + 2 * problem.comm_beta_s_per_byte * v.bytes for v in _values(problem)]
    return sum(problem.block_time_s) + 2 * sum(per_value)


# -- the solver ---------------------------------------------------------------------------


def solve(problem: PartitionProblem, time_limit_s: float = 30.0, *, seed: int = 0, workers: int = 1,
          nodes: int = 0) -> tuple[tuple[int, ...], SolverReport]:
    """The stage of each block, and how it was found.

    `time_limit_s` is CP-SAT's deterministic time (about seconds, the same on every run);
    `nodes` is only reported.  Raises PlanError when the stages cannot all be filled and
    InfeasiblePlanError when no plan fits the memory limit.
    """
    start = time.perf_counter()
    _check(problem)
    dp = _dp(problem)
    report = SolverReport(method="dp", objective_s=0.0, lower_bound_s=0.0, wall_s=0.0, status="OPTIMAL",
                          blocks=problem.num_blocks, nodes=nodes)
    best, bound = dp, _trivial_bound(problem)
    if _exact(problem):
        bound = math.inf  # the DP saw every valid plan
    elif time_limit_s > 0:
        upper = objective(problem, dp) if dp is not None else None
        cp = solve_cpsat(problem, time_limit_s, hint=dp, upper_bound_s=upper, seed=seed, workers=workers)
        bound = max(bound, cp.lower_bound_s)
        report = replace(report, method="dp+cpsat", status=cp.status)
        if cp.assignment is not None and (upper is None or objective(problem, cp.assignment) < upper * (1 - _BETTER)):
            best, report = cp.assignment, replace(report, method="cpsat")
    else:
        report = replace(report, status="FEASIBLE")
    if best is None or not math.isfinite(objective(problem, best)):
        search = "chain" if _exact(problem) else "proved" if report.status == "INFEASIBLE" else "unknown"
        raise _infeasible(problem, search)
    slowest = objective(problem, best)
    return best, replace(report, objective_s=slowest, lower_bound_s=min(bound, slowest),
                         wall_s=time.perf_counter() - start)


def _check(problem: PartitionProblem) -> None:
    n, stages = problem.num_blocks, problem.stages
    if stages < 1:
        raise PlanError(f"--stages {stages}: a pipeline needs at least one stage.")
    if stages > n:
        raise PlanError(f"--stages {stages} is more than the {n} blocks the graph coarsened into, and every "
                        f"stage needs at least one block: use --stages {n} or fewer.")
    if problem.microbatches < 1:
        raise PlanError(f"--microbatches {problem.microbatches}: need at least one microbatch.")


def _trivial_bound(problem: PartitionProblem) -> float:
    """No plan beats its largest block, nor an even share of all compute."""
    times = problem.block_time_s
    return max(max(times), sum(times) / problem.stages)


# -- infeasible: both sides and the fix --------------------------------------------------


def _infeasible(problem: PartitionProblem, search: str) -> InfeasiblePlanError:
    """Name the leanest plan's fullest stage, its parts, and what would fit instead."""
    limit = problem.memory_limit_bytes
    assert limit is not None
    lean = _dp(problem, by="memory")
    assert lean is not None
    costs = stage_costs(problem, lean)
    k = max(range(problem.stages), key=lambda s: costs[s].memory_bytes)
    c, need = costs[k], _size(costs[k].memory_bytes)
    flight = f"{c.inflight} microbatch{'es' if c.inflight != 1 else ''} in flight"
    parts = (f"weights {_size(c.weight_bytes)}, gradients {_size(c.weight_bytes)}, optimizer "
             f"{_size(c.weight_bytes * problem.optimizer_factor)}, activations {_size(c.activation_bytes * c.inflight)}"
             f" for {flight}")
    into = f"into {problem.stages} stage{'s' if problem.stages != 1 else ''}"
    head = {"chain": f"every plan {into} needs at least {need} on one stage",
            "proved": f"CP-SAT proved that no plan {into} fits",
            "unknown": f"no plan {into} that fits was found within --time-limit"}[search]
    fits = _stages_that_fit(problem, limit)
    fix = (f"use --stages {fits} (fits) or raise --memory to {need}" if fits else f"raise --memory to {need}")
    more = " (or raise --time-limit)" if search == "unknown" else ""
    return InfeasiblePlanError(f"{head}: the leanest puts {need} on stage {k} ({parts}) but --memory is "
                               f"{_size(limit)} per stage: {fix}{more}.")


def _stages_that_fit(problem: PartitionProblem, limit: int, most: int = 64) -> int | None:
    """The smallest stage count above the problem's whose leanest contiguous plan fits."""
    for stages in range(problem.stages + 1, min(problem.num_blocks, problem.stages + most) + 1):
        wider = replace(problem, stages=stages)
        lean = _dp(wider, by="memory")
        if lean is not None and max(evaluate(wider, lean)[1]) <= limit:
            return stages
    return None


def _size(size: int) -> str:
    """Bytes for people: '21.4 GiB', '3.0 MiB', '12 B'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"
