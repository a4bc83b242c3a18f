"""Step 2 of `solve`: CP-SAT on the general DAG assignment ([Note: the cost model] in model.py).

The model minimises the slowest pipeline rank (the sum of its stages' times), or under
interleaved 1F1B the slowest virtual stage ([Note: what the schedule runs] in model.py);
then, lexicographically, among the plans with that slowest, the sum of the ranks' (stages')
excess over the mean compute (balance), and among those the bytes sent between ranks
(`_CpModel.refine`).  Each rank's memory, its stages' summed, is bounded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from ortools.sat.python import cp_model

from ..cost.costmodel import computing_blocks, message_s, pair_bytes, shared_params, values
from ..ir import PartitionProblem
from .model import interleaved

__all__ = ["CpResult", "solve_cpsat"]

#: CP-SAT works in integer units: the upper bound on the slowest stage becomes this many.
_UNITS = 1e9
#: bytes are counted in units that keep the traffic objective's coefficients small
_BYTE_UNITS = 10**6


@dataclass(frozen=True)
class CpResult:
    """What CP-SAT returned: its status, its plan (if any) and the bound it proved."""

    status: str
    assignment: tuple[int, ...] | None
    lower_bound_s: float


class _CpModel:
    """The stage assignment as CP-SAT booleans, in the order encoding.

    ge[i][k] is stage(i) >= k (ge[i][0] is True, ge[i][S] False), so an edge is S-1
    implications; at[i][k] is stage(i) == k.  recv[v][k] says that stage k receives value
    v from another rank, pair[a][b] that stage a sends stage b a message ([Note: the cost
    of a boundary]; no pair of stages on one rank has one), sent[v][k] the units stage k
    pays to send v (its bytes once per reader stage, when v is made there), held[q][r]
    that rank r holds shared parameter q: they are only forced up, which minimising the
    slowest rank never needs more of, so the optimum and the proved bound are the cost
    model's.  Times are integer units rounded down, so a bound in units is a bound in
    seconds.
    """

    def __init__(self, problem: PartitionProblem, scale: float, upper_units: int) -> None:
        self.problem, self.scale, self.model = problem, scale, cp_model.CpModel()
        self.upper_units = upper_units
        self.values, (self.own, self.shared) = values(problem), shared_params(problem)
        self.placed = problem.placement
        self.on = [[k for k in range(problem.stages) if self.placed[k] == r] for r in range(problem.ranks)]
        #: the stages whose summed time paces the schedule: each rank's, or each stage alone
        self.paced = [[k] for k in range(problem.stages)] if interleaved(problem) else self.on
        self._add_placement()
        self._add_indicators()
        units = [self._units(t) for t in problem.block_time_s]  # nothing that paces is faster than these
        least = max(max(units), -(-sum(units) // len(self.paced)))
        self.slowest = self.model.new_int_var(min(least, upper_units), upper_units, "slowest")
        for mine in self.paced:
            self.model.add(self.slowest >= self._time(mine))
        for r in range(problem.ranks):
            if problem.memory_limit_bytes is not None:
                self.model.add(self._memory(r) <= problem.memory_limit_bytes)
                self.model.add(self._memory_after(r) <= problem.memory_limit_bytes)
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
        computing = computing_blocks(self.problem)
        every = computing if len(computing) >= S else range(n)  # no stage without compute, when they can all have some
        for k in range(S):
            m.add_bool_or([self.at[i][k] for i in every])

    def _add_indicators(self) -> None:
        """recv/sent of each value and the stage pairs' messages, per stage, and held of
        each shared parameter, per rank."""
        m, p, S, placed = self.model, self.problem, self.problem.stages, self.placed
        self.recv = [[m.new_bool_var(f"r{j}_{k}") for k in range(S)] for j in range(len(self.values))]
        self.pair = {(a, b): m.new_bool_var(f"p{a}_{b}") for a in range(S) for b in range(a + 1, S)
                     if placed[a] != placed[b]}
        self.byte_units = [self._units(2 * message_s(0.0, p.comm_beta_s_per_byte, v.bytes)) for v in self.values]
        self.sent = [[m.new_int_var(0, c * S, f"s{j}_{k}") for k in range(S)] for j, c in enumerate(self.byte_units)]
        for j, v in enumerate(self.values):
            for k, r in ((k, r) for k in range(S) for r in v.readers):
                # made before k and not on k's rank: a stage of k's rank before it hands v over in memory
                beside = [self.at[v.producer][a] for a in range(k) if placed[a] == placed[k]]
                m.add_bool_or([~self.at[r][k], self.ge[v.producer][k], *beside, self.recv[j][k]])
                for a in (a for a in range(k) if (a, k) in self.pair):
                    m.add_bool_or([~self.at[v.producer][a], ~self.at[r][k], self.pair[(a, k)]])
            for k in range(S - 1):
                if self.byte_units[j]:
                    later = sum(self.recv[j][b] for b in range(k + 1, S))
                    m.add(self.sent[j][k] >= self.byte_units[j] * later).only_enforce_if(self.at[v.producer][k])
        # the bytes each stage sends other ranks, each value once: what the memory model holds
        self.sent_bytes = [[m.new_int_var(0, v.bytes, f"b{j}_{k}") for k in range(S)] for j, v in enumerate(self.values)]
        for j, v in enumerate(self.values):
            for k, b in ((k, b) for k in range(S - 1) for b in range(k + 1, S)) if p.holds_messages and v.bytes else ():
                m.add(self.sent_bytes[j][k] >= v.bytes * self.recv[j][b]).only_enforce_if(self.at[v.producer][k])
        self.recv_any = self.recv  # what a recomputing stage keeps: its inputs, whoever made them
        if p.recompute and p.virtual_stages > 1:
            self.recv_any = [[m.new_bool_var(f"i{j}_{k}") for k in range(S)] for j in range(len(self.values))]
            for j, v in enumerate(self.values):
                for k, r in ((k, r) for k in range(S) for r in v.readers):
                    m.add_bool_or([~self.at[r][k], self.ge[v.producer][k], self.recv_any[j][k]])
        self.held = [[m.new_bool_var(f"q{j}_{r}") for r in range(p.ranks)] for j in range(len(self.shared))]
        for j, (_, blocks) in enumerate(self.shared):
            for k, b in ((k, b) for k in range(S) for b in blocks):
                m.add_implication(self.at[b][k], self.held[j][placed[k]])

    def _units(self, seconds: float) -> int:
        return int(math.floor(seconds * self.scale))

    def _time(self, mine: Sequence[int]) -> cp_model.LinearExprT:
        """The time in units of the stages `mine` (a rank's, or one): compute and messages."""
        p = self.problem
        compute = [self._units(t) * self.at[i][k] for i, t in enumerate(p.block_time_s) for k in mine]
        received = [c * self.recv[j][k] + self.sent[j][k] for j, c in enumerate(self.byte_units) if c for k in mine]
        latency = self._units(2 * message_s(p.comm_alpha_s, 0.0, 0))
        pairs = [x for (a, b), x in self.pair.items() for k in mine if k in (a, b)] if latency else []
        return sum(compute) + sum(received) + latency * sum(pairs)

    def _memory(self, r: int) -> cp_model.LinearExprT:
        """Rank r's memory: its stages' blocks (seeds included), inputs, working sets and
        the messages they exchange with other ranks, each shared parameter once."""
        p, per = self.problem, 2 + self.problem.optimizer_factor
        kept = p.block_kept_bytes or (0,) * p.num_blocks  # selective recomputation's, per microbatch in flight
        seeds = p.block_seed_bytes or (0,) * p.num_blocks  # a split backward's, per W awaited
        blocks = [(round(per * own) + (1 if p.recompute else p.resident(k)) * act + p.inflight(k) * keep
                   + p.awaiting_w(k) * seed) * self.at[i][k]
                  for i, (own, act, keep, seed) in enumerate(zip(self.own, p.block_activation_bytes, kept, seeds))
                  for k in self.on[r]]
        inputs = [p.inflight(k) * v.bytes * self.recv_any[j][k] for j, v in enumerate(self.values)
                  for k in self.on[r]] if p.recompute else []
        messages = [(p.microbatches + 2) * (v.bytes * self.recv[j][k] + self.sent_bytes[j][k])
                    for j, v in enumerate(self.values) for k in self.on[r]] if p.holds_messages else []
        return (sum(blocks) + sum(inputs) + sum(messages) + p.working_bytes * len(self.on[r])
                + sum(round(per * size) * self.held[j][r] for j, (size, _) in enumerate(self.shared)))

    def _memory_after(self, r: int) -> cp_model.LinearExprT:
        """Rank r's memory after its last backward: its weights' terms and the optimizer
        step's temporaries, or dp's buckets, a copy of its gradients (`model.after_bytes`)."""
        p, per = self.problem, 2 + self.problem.optimizer_factor + (1 if self.problem.buckets else 0)
        weights = (sum(round(per * own) * self.at[i][k] for i, own in enumerate(self.own) for k in self.on[r])
                   + sum(round(per * size) * self.held[j][r] for j, (size, _) in enumerate(self.shared)))
        return weights + (0 if p.buckets else p.step_bytes)

    def hint(self, assignment: Sequence[int]) -> None:
        """Warm-start from `assignment`, auxiliary booleans included."""
        m, S, placed = self.model, self.problem.stages, self.placed
        for i, s in enumerate(assignment):
            for k in range(S):
                m.add_hint(self.at[i][k], s == k)
                if 0 < k:
                    m.add_hint(self.ge[i][k], s >= k)  # type: ignore[arg-type]  # a variable for 0 < k < S
        for j, v in enumerate(self.values):
            home, later = assignment[v.producer], {assignment[r] for r in v.readers}
            remote = {b for b in later if b > home and placed[b] != placed[home]}
            for k in range(S):
                m.add_hint(self.recv[j][k], k in remote)
                m.add_hint(self.sent[j][k], self.byte_units[j] * len([b for b in remote if b > k]) if home == k else 0)
                if self.recv_any is not self.recv:
                    m.add_hint(self.recv_any[j][k], home < k and k in later)
        talks = pair_bytes((assignment[v.producer], [assignment[r] for r in v.readers], 1) for v in self.values)
        for pair, x in self.pair.items():
            m.add_hint(x, pair in talks)
        for j, (_, blocks) in enumerate(self.shared):
            for r in range(self.problem.ranks):
                m.add_hint(self.held[j][r], r in {placed[assignment[b]] for b in blocks})

    def read(self, solver: cp_model.CpSolver) -> tuple[int, ...]:
        return tuple(sum(int(solver.boolean_value(g)) for g in ge[1:-1]) for ge in self.ge)

    def refine(self, solver: cp_model.CpSolver) -> tuple[int, ...]:
        """The second and third objectives, with the slowest held to the one found: the
        least excess of the ranks (stages, under interleaved 1F1B) over the mean compute, then the fewest bytes sent
        between ranks (each value once per stage that receives it).  Returns the plan
        found last."""
        m, p, S = self.model, self.problem, self.problem.stages
        best = self.read(solver)
        m.add(self.slowest <= solver.value(self.slowest))
        mean = self._units(sum(p.block_time_s) / len(self.paced))
        excess = [m.new_int_var(0, self.upper_units, f"x{r}") for r in range(len(self.paced))]
        for mine, x in zip(self.paced, excess):
            m.add(x >= self._time(mine) - mean)
        unit = max(1, max((v.bytes for v in self.values), default=1) // _BYTE_UNITS)
        traffic = sum(-(-v.bytes // unit) * self.recv[j][k] for j, v in enumerate(self.values) for k in range(S))
        for objective in (sum(excess), traffic):
            m.clear_hints()
            self.hint(best)
            m.minimize(objective)
            if solver.solve(m) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
                break
            best = self.read(solver)
            m.add(objective <= int(solver.objective_value))
        return best


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
    if not found:
        return CpResult(status, None, max(0.0, bound))
    params.max_deterministic_time = time_limit_s / 4  # each further objective
    return CpResult(status, cp.refine(solver), max(0.0, bound))


def _worst_time(problem: PartitionProblem) -> float:
    """A rank's time no plan exceeds: all compute and, for each of its stages, a message
    to and from every other stage, and every value sent to every stage and received."""
    S = problem.stages
    per_value = [2 * message_s(0.0, problem.comm_beta_s_per_byte, v.bytes) * (S + 1) for v in values(problem)]
    messages = sum(per_value) + 2 * S * message_s(problem.comm_alpha_s, 0.0, 0)
    return sum(problem.block_time_s) + problem.virtual_stages * messages


