"""The tensor-parallel problem as plain data: a variable per graph value, a cost per
strategy, a cost matrix per edge and the copies some readers need (see `choose` for how it
is solved, `chain` for its exact DP on path-like graphs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["CopyCost", "EdgeCost", "ShardingProblem", "ShardingReport", "sharding_cost"]


@dataclass(frozen=True)
class EdgeCost:
    """The value `src` read by `dst`: cost[i][j] when src takes strategy i and dst strategy j."""

    src: int
    dst: int
    cost: tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class CopyCost:
    """`cost_s` is paid once if any (dst, strategy) in `readers` is chosen."""

    value: int
    cost_s: float
    readers: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class ShardingProblem:
    """Variables 0..n-1, each with its strategies' costs; strategy 0 is always allowed
    (replicate), and choosing 0 everywhere costs no conversion."""

    names: tuple[str, ...]
    cost_s: tuple[tuple[float, ...], ...]
    edges: tuple[EdgeCost, ...]
    copies: tuple[CopyCost, ...] = ()

    @property
    def size(self) -> int:
        return len(self.names)


@dataclass(frozen=True)
class ShardingReport:
    method: str
    status: str
    objective_s: float
    replicated_s: float
    lower_bound_s: float
    wall_s: float
    variables: int


def sharding_cost(problem: ShardingProblem, choice: Sequence[int]) -> float:
    """The cost of one strategy per variable (inf when an edge cannot convert)."""
    total = sum(costs[k] for costs, k in zip(problem.cost_s, choice))
    total += sum(e.cost[choice[e.src]][choice[e.dst]] for e in problem.edges)
    total += sum(c.cost_s for c in problem.copies if any(choice[d] == j for d, j in c.readers))
    return total
