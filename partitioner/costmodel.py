"""What the cost model reads off a `PartitionProblem`: the values that cross blocks and the
parameters that several blocks share.

`solve.stage_costs` ([Note: the cost model]), the interval DP (`intervals`) and the CP-SAT
model all sum over these tables; they live here, below all three, so that `intervals`
needs nothing from `solve` and `solve` imports `intervals` without a cycle.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, TypeVar

from .ir import PartitionProblem

__all__ = ["Value", "shared_params", "values"]

_T = TypeVar("_T")


@dataclass(frozen=True)
class Value:
    """A value that crosses blocks: the block that makes it, those that read it, its size."""

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
def values(problem: PartitionProblem) -> tuple[Value, ...]:
    """The distinct values that cross blocks, keyed by (producer, name), in edge order."""
    readers: dict[tuple[int, str], set[int]] = {}
    sizes: dict[tuple[int, str], int] = {}
    for e in problem.edges:
        key = (e.src, e.value)
        readers.setdefault(key, set()).add(e.dst)
        sizes[key] = max(sizes.get(key, 0), e.bytes)
    return tuple(Value(key[0], tuple(sorted(r)), sizes[key]) for key, r in readers.items())


@_per_problem
def shared_params(problem: PartitionProblem) -> tuple[tuple[int, ...], tuple[tuple[int, tuple[int, ...]], ...]]:
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
