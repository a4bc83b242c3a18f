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

from ..ir import PartitionProblem

__all__ = ["Value", "shared_params", "values"]

_T = TypeVar("_T")


@dataclass(frozen=True)
class Value:
    """A value that crosses blocks: the block that makes it, those that read it, its size."""

    producer: int
    readers: tuple[int, ...]  # sorted, all > producer in a topological order
    bytes: int


def _per_problem(*fields: str) -> Callable[[Callable[[PartitionProblem], _T]], Callable[[PartitionProblem], _T]]:
    """Cache fn(problem) for the last few problems by the identity of the `fields` fn
    reads (hashing them is slow); problems that share those tuples (one problem posed
    for several stage counts, `dataclasses.replace`) share the entry."""

    def wrap(fn: Callable[[PartitionProblem], _T]) -> Callable[[PartitionProblem], _T]:
        cache: dict[tuple[int, ...], tuple[tuple[object, ...], _T]] = {}

        def cached(problem: PartitionProblem) -> _T:
            parts = tuple(getattr(problem, f) for f in fields)
            key = tuple(id(p) for p in parts)
            hit = cache.get(key)
            if hit is None or any(a is not b for a, b in zip(hit[0], parts)):
                if len(cache) >= 8:
                    cache.pop(next(iter(cache)))
                hit = cache[key] = (parts, fn(problem))  # the parts held, so their ids stay theirs
            return hit[1]

        return functools.wraps(fn)(cached)

    return wrap


@_per_problem("edges")
def values(problem: PartitionProblem) -> tuple[Value, ...]:
    """The distinct values that cross blocks, keyed by (producer, name), in edge order."""
    readers: dict[tuple[int, str], set[int]] = {}
    sizes: dict[tuple[int, str], int] = {}
    for e in problem.edges:
        key = (e.src, e.value)
        readers.setdefault(key, set()).add(e.dst)
        sizes[key] = max(sizes.get(key, 0), e.bytes)
    return tuple(Value(key[0], tuple(sorted(r)), sizes[key]) for key, r in readers.items())


@_per_problem("block_params", "param_bytes_by_name", "block_param_bytes")
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
