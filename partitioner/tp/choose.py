"""Choose a strategy per value: the tensor-parallel problem as plain data, CP-SAT and brute force.

The problem is Alpa's intra-operator ILP (Zheng et al., OSDI 2022, section 4.2) over our
layouts: one variable per graph value (an input, a parameter, a node, the output) with a
cost per strategy (its compute on one rank and the collectives inside it), a cost matrix
per edge (converting the producer's layout into the one the consumer needs: all_gather,
slicing; `inf` where no conversion exists), and a cost per value that some chosen
consumer reads as a partial-gradient input (one `tp.copy`, an all_reduce backward).
Minimising the sum is the time of one microbatch's forward and backward on one rank.
"""

from __future__ import annotations

import itertools
import math
import time

from ortools.sat.python import cp_model

from . import chain
from .problem import ShardingProblem, ShardingReport, sharding_cost

__all__ = ["choose", "brute_force"]

_UNITS = 10_000_000  # the objective's integer resolution (of the all-replicated cost)


def brute_force(problem: ShardingProblem) -> tuple[tuple[int, ...], float]:
    """Every combination: for tests on tiny problems."""
    best: tuple[tuple[int, ...], float] = (tuple(0 for _ in problem.names), math.inf)
    for choice in itertools.product(*(range(len(c)) for c in problem.cost_s)):
        value = sharding_cost(problem, choice)
        if value < best[1]:
            best = (choice, value)
    return best


def choose(problem: ShardingProblem, time_limit_s: float = 10.0, seed: int = 0,
           method: str = "auto") -> tuple[tuple[int, ...], ShardingReport]:
    """The cheapest strategy per variable.

    `method` "auto": the exact chain DP (`chain.py`) when the problem is path-like (a
    transformer), else CP-SAT; "cpsat": CP-SAT alone, within `time_limit_s` of
    deterministic time, warm-started with all-replicated.
    """
    start = time.perf_counter()
    base = tuple(0 for _ in problem.names)
    replicated = sharding_cost(problem, base)
    if all(len(c) == 1 for c in problem.cost_s):
        return base, ShardingReport("trivial", "OPTIMAL", replicated, replicated, replicated,
                                    time.perf_counter() - start, 0)
    if method not in ("auto", "cpsat"):
        raise ValueError(f"unknown method {method!r}: use 'auto' or 'cpsat'")
    found = chain.solve_chain(problem) if method == "auto" else None
    if found is not None:
        value = sharding_cost(problem, found)
        choice, value = (found, value) if value <= replicated else (base, replicated)
        return choice, ShardingReport("chain", "OPTIMAL", value, replicated, value, time.perf_counter() - start,
                                      sum(len(c) for c in problem.cost_s if len(c) > 1))
    model = _Model(problem, _UNITS / max(replicated, 1e-12))
    solver = cp_model.CpSolver()
    solver.parameters.max_deterministic_time = time_limit_s
    solver.parameters.random_seed = seed
    solver.parameters.num_workers = 1
    status = solver.status_name(solver.solve(model.model))
    if status not in ("OPTIMAL", "FEASIBLE"):
        return base, ShardingReport("cpsat", status, replicated, replicated, 0.0, time.perf_counter() - start,
                                    model.variables)
    choice = model.read(solver)
    value = sharding_cost(problem, choice)
    if value > replicated:  # rounding can only make it worse than the hint by a unit
        choice, value = base, replicated
    bound = min(value, solver.best_objective_bound / model.scale + model.constant)
    return choice, ShardingReport("cpsat", status, value, replicated, bound, time.perf_counter() - start,
                                  model.variables)


class _Model:
    """The CP-SAT model: a boolean per (variable, strategy) where there is a choice."""

    def __init__(self, problem: ShardingProblem, scale: float) -> None:
        self.problem, self.scale, self.constant = problem, scale, 0.0
        m = self.model = cp_model.CpModel()
        self.x: list[list[cp_model.IntVar] | None] = []
        terms: list[tuple[cp_model.IntVar, int]] = []
        for v, seconds in enumerate(problem.cost_s):
            if len(seconds) == 1:
                self.x.append(None)
                self.constant += seconds[0]
                continue
            row = [m.new_bool_var(f"x{v}_{k}") for k in range(len(seconds))]
            m.add_exactly_one(row)
            for k, lit in enumerate(row):
                m.add_hint(lit, k == 0)
                terms.append((lit, self._int(seconds[k])))
            self.x.append(row)
        self.variables = sum(len(r) for r in self.x if r is not None)
        for e in problem.edges:
            for i, costs in enumerate(e.cost):
                for j, c in enumerate(costs):
                    if c:
                        self._pair(e.src, i, e.dst, j, c, terms)
        for copy in problem.copies:
            lits = [self._lit(d, j) for d, j in copy.readers]
            if any(lit is True for lit in lits):
                self.constant += copy.cost_s
                continue
            live = [lit for lit in lits if not isinstance(lit, bool)]
            if live:
                y = m.new_bool_var(f"copy{copy.value}")
                for lit in live:
                    m.add_implication(lit, y)
                terms.append((y, self._int(copy.cost_s)))
        m.minimize(sum(k * lit for lit, k in terms if k))

    def _int(self, seconds: float) -> int:
        return int(round(seconds * self.scale))

    def _lit(self, v: int, k: int) -> cp_model.IntVar | bool:
        row = self.x[v]
        if row is None:
            return k == 0
        return row[k]

    def _pair(self, u: int, i: int, v: int, j: int, cost: float, terms: list[tuple[cp_model.IntVar, int]]) -> None:
        a, b = self._lit(u, i), self._lit(v, j)
        if a is False or b is False:
            return
        if math.isinf(cost):
            if a is True and b is True:
                raise ValueError(f"variables {u} and {v} have no allowed pair")
            if a is True or b is True:
                self.model.add((b if a is True else a) == 0)  # type: ignore[operator]
            else:
                self.model.add_bool_or([a.Not(), b.Not()])  # type: ignore[union-attr]
            return
        if a is True and b is True:
            self.constant += cost
        elif a is True or b is True:
            terms.append((b if a is True else a, self._int(cost)))  # type: ignore[arg-type]
        else:
            z = self.model.new_bool_var(f"e{u}_{i}_{v}_{j}")
            self.model.add_bool_or([a.Not(), b.Not(), z])  # type: ignore[union-attr]
            terms.append((z, self._int(cost)))

    def read(self, solver: cp_model.CpSolver) -> tuple[int, ...]:
        return tuple(0 if row is None else next(k for k, lit in enumerate(row) if solver.boolean_value(lit))
                     for row in self.x)
