"""What the cost model reads off a `PartitionProblem`: the values that cross blocks and the
parameters that several blocks share.

`model.stage_costs` ([Note: the cost model] in solve/model.py), the DPs (`intervals`,
`vee`) and the CP-SAT model all sum over these tables; they live here, below all of them,
so that none needs another and `solve` imports them all without a cycle.

[Note: the cost of a boundary]
    The runtime sends all the values one stage hands another for a microbatch as ONE
    packed message (`runtime/messages.py`, [Note: one message per hand-over]), straight
    from the stage that made them to each stage that reads them.  So the cost of the
    boundaries is a sum over stage PAIRS (a, b), a < b, that exchange anything:

        bytes(a, b) = the sizes of the values made on a that b reads (`pair_bytes`),
                      a value read on several later stages counted once per reader stage
        one message = alpha + beta * bytes(a, b)                            (`message_s`)

    and each stage pays, for every pair it is in, one message forward (the values) and
    one backward (their gradients): `boundary_s`.  In the solver's stage time, alpha is
    what a message costs each END's own time (`predict.stage_message_s`): the link's
    latency where a receive is posted just before it is waited for (NCCL), but on gloo,
    where receives are posted a compute ahead ([Note: receives posted ahead] in
    runtime/schedule/lowering.py), only posting the send and the receive, since the message moves
    during that compute; the simulator plays the latency out where it falls.  A pair of
    stages on the same pipeline rank (interleaved, the turn of zb-v's V: [Note: V
    placement] in runtime/schedule/registry.py) sends nothing: the runtime hands the values over in
    memory and `lower` emits no message, so such a pair costs nothing (`remote`).  `model.stage_costs` (the model the
    solver minimises, the brute-force tests evaluate every plan with) and the step
    simulator's links (`predict.simulate_plan`) call these functions; the CP-SAT model
    writes the same sum linearly (an indicator per pair for alpha, the bytes per value
    and reader stage for beta), and the interval DP minimises a lower bound of it (alpha
    once per side of a run, each value's bytes once) whose plan `solve` then evaluates
    exactly, proving it optimal when the two agree.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence, TypeVar

import numpy as np

from ..ir import PartitionProblem

__all__ = ["Value", "boundary_s", "computing_blocks", "message_s", "pair_bytes", "param_bytes_once", "per_problem",
           "remote", "shared_params", "stage_pairs", "values"]

_T = TypeVar("_T")


@dataclass(frozen=True)
class Value:
    """A value that crosses blocks: the block that makes it, those that read it, its size."""

    producer: int
    readers: tuple[int, ...]  # sorted, all > producer in a topological order
    bytes: int


def per_problem(*fields: str, by_value: tuple[str, ...] = (), kept: int = 8
                ) -> Callable[[Callable[[PartitionProblem], _T]], Callable[[PartitionProblem], _T]]:
    """Cache fn(problem) for the last `kept` problems by the identity of the `fields` fn
    reads (hashing them is slow) and the values of the `by_value` ones (numbers each
    problem is posed with anew); problems that share those tuples (one problem posed for
    several stage counts, `dataclasses.replace`) share the entry."""

    def wrap(fn: Callable[[PartitionProblem], _T]) -> Callable[[PartitionProblem], _T]:
        cache: dict[tuple[object, ...], tuple[tuple[object, ...], _T]] = {}

        def cached(problem: PartitionProblem) -> _T:
            parts = tuple(getattr(problem, f) for f in fields)
            key = tuple(id(p) for p in parts) + tuple(getattr(problem, f) for f in by_value)
            hit = cache.get(key)
            if hit is None or any(a is not b for a, b in zip(hit[0], parts)):
                if len(cache) >= kept:
                    cache.pop(next(iter(cache)))
                hit = cache[key] = (parts, fn(problem))  # the parts held, so their ids stay theirs
            return hit[1]

        return functools.wraps(fn)(cached)

    return wrap


def computing_blocks(problem: PartitionProblem) -> list[int]:
    """The blocks that compute ([Note: every stage computes] in solve/solve.py): each stage
    gets one while there are enough."""
    computes = problem.block_computes or tuple(t > 0 for t in problem.block_time_s)
    return [i for i, c in enumerate(computes) if c]


@per_problem("edges")
def values(problem: PartitionProblem) -> tuple[Value, ...]:
    """The distinct values that cross blocks, keyed by (producer, name), in edge order."""
    readers: dict[tuple[int, str], set[int]] = {}
    sizes: dict[tuple[int, str], int] = {}
    for e in problem.edges:
        key = (e.src, e.value)
        readers.setdefault(key, set()).add(e.dst)
        sizes[key] = max(sizes.get(key, 0), e.bytes)
    return tuple(Value(key[0], tuple(sorted(r)), sizes[key]) for key, r in readers.items())


@per_problem("block_params", "param_bytes_by_name", "block_param_bytes")
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


# -- [Note: the cost of a boundary] --------------------------------------------------------


def param_bytes_once(problem: PartitionProblem) -> int:
    """The bytes of every parameter, each held once (a shared one once, not per reader)."""
    own, shared = shared_params(problem)
    return sum(own) + sum(size for size, _ in shared)


def message_s(alpha: float, beta: float, nbytes: float) -> float:
    """One message between a stage pair: its latency once, and `nbytes` at `beta` s/byte."""
    return alpha + beta * nbytes


def pair_bytes(crossings: Iterable[tuple[int, Iterable[int], int]]) -> dict[tuple[int, int], int]:
    """The bytes of each stage pair's message, from (home stage, reader stages, bytes) per
    value: a value goes once to each distinct stage after its home that reads it."""
    pairs: dict[tuple[int, int], int] = {}
    for home, readers, nbytes in crossings:
        for k in sorted({r for r in readers if r > home}):
            pairs[(home, k)] = pairs.get((home, k), 0) + nbytes
    return pairs


def stage_pairs(problem: PartitionProblem, assignment: Sequence[int]) -> dict[tuple[int, int], int]:
    """`pair_bytes` of `problem`'s values under `assignment` (a stage per block), the same
    dict in the same order (the order in which the values first reach each pair, which
    sums of seconds over it follow), taken over the values' readers at once."""
    producer, nbytes, value_of, reader = _crossings(problem)
    stage = np.asarray(assignment, dtype=np.int64)
    if not len(reader):
        return {}
    home, to, count = stage[producer], stage[reader], int(stage.max()) + 1
    later = to > home[value_of]
    value, k = np.divmod(np.unique(value_of[later] * count + to[later]), count)  # each value once per stage, in order
    pairs, first, inverse = np.unique(home[value] * count + k, return_index=True, return_inverse=True)
    sums = np.zeros(len(pairs), dtype=np.int64)
    np.add.at(sums, inverse, nbytes[value])
    order = np.argsort(first, kind="stable")
    return {divmod(pair, count): size for pair, size in zip(pairs[order].tolist(), sums[order].tolist())}


@per_problem("edges")
def _crossings(problem: PartitionProblem) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`values` as arrays: each value's producer and bytes, and per (value, reader) the
    value's index and the reader."""
    found = values(problem)
    readers = [len(v.readers) for v in found]
    return (np.array([v.producer for v in found], dtype=np.int64), np.array([v.bytes for v in found], dtype=np.int64),
            np.repeat(np.arange(len(found), dtype=np.int64), readers),
            np.array([r for v in found for r in v.readers], dtype=np.int64))


def remote(pairs: Mapping[tuple[int, int], int], ranks: Sequence[int]) -> dict[tuple[int, int], int]:
    """The stage pairs of `pairs` whose stages are on different ranks (`ranks`: the rank
    of each stage): the others hand their values over in memory, for free."""
    return {(a, b): nbytes for (a, b), nbytes in pairs.items() if ranks[a] != ranks[b]}


def boundary_s(pairs: Mapping[tuple[int, int], int], alpha: float, beta: float, stages: int) -> list[float]:
    """Each stage's seconds of messages per microbatch: for every pair it sends to or
    receives from, one message forward and one (the gradients) backward."""
    out = [0.0] * stages
    for (a, b), nbytes in pairs.items():
        both = 2 * message_s(alpha, beta, nbytes)
        out[a] += both
        out[b] += both
    return out
