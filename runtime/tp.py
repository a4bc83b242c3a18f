"""Tensor-parallel collectives: what generated stage code calls (`from runtime import tp`).

Megatron-LM (Shoeybi et al., 2019, arXiv:1909.08053, section 3) splits a layer over the T
ranks of a tensor-parallel group with operations that come in conjugate pairs: the
backward of each one is the forward of its partner, so gradients stay exact.

    tp.copy(x)             forward: identity               backward: all_reduce (sum)   Megatron's f
    tp.all_reduce(x)       forward: all_reduce (sum)       backward: identity           Megatron's g
    tp.scatter(x, dim)     forward: this rank's shard      backward: all_gather
    tp.all_gather(x, dim)  forward: every shard, in order  backward: this rank's shard
    tp.reduce_scatter(x, dim)  forward: the sum's shard    backward: all_gather

A partial sum (every rank holds a part, the value is their sum) is made whole by
`tp.all_reduce` or sharded by `tp.reduce_scatter`; `tp.first_rank(b)` adds a bias to a
partial sum once (b on the first rank, 0 elsewhere, still in every rank's graph).
`with tp.rank_stream(x.device, self.training):` gives a dropout of a sharded value this
rank's own random stream ([Note: dropout streams] in modes.py).

A column-parallel linear (weight rows split) reads `tp.copy(x)` and ends with its output
sharded (or `tp.all_gather`ed); a row-parallel linear (weight columns split) ends with
`tp.all_reduce` of its partial sums.  Every value outside those regions is replicated:
each rank of the group computes it identically, so a replicated parameter's gradient
is the same everywhere without further communication.

`blocks=b` splits a fused dimension (a qkv weight's 3C rows) as b equal blocks, each cut
in T shards: rank r holds piece r of every block, concatenated.

The group is one of two kinds:

    torch.distributed  `tp.set_group` (DistributedPipeline), process-wide: one process
                       per tp index.  Every collective is posted asynchronously and
                       waited with a timeout: a dead or silent peer raises `PeerError`
                       naming the collective, never hangs (comm.wait).
    in-process         `Lanes` (LocalPipeline): T lanes, threads of this process, each a
                       tp index holding its own shards, entered with `tp.lane(lanes, t)`
                       (per thread, over the process-wide group).  [Note: lanes] in lanes.py

With no group set (or a group of one), every function returns its input, so a tp=1 run
and a plain import cost nothing.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from . import modes
from .comm import DEFAULT_TIMEOUT_S, guard, wait
from .errors import PipelineError
from .lanes import Lanes

__all__ = [
    "all_reduce",
    "copy",
    "all_gather",
    "scatter",
    "vocab_shard",
    "rank",
    "size",
    "set_group",
    "reset",
    "Lanes",
    "lane",
    "local_shard",
    "join_shards",
    "rank_stream",
]

Describe = Callable[[str, bool, str], str]  # (collective, timed out?, reason) -> the PeerError message


@dataclass(frozen=True)
class _Group:
    handle: Any = None  # a torch.distributed group; None is the default (world) group
    rank: int = 0
    size: int = 1
    timeout_s: float = DEFAULT_TIMEOUT_S
    describe: Describe | None = None
    lanes: Lanes | None = None  # set: an in-process group, this thread being lane `rank`


_group = _Group()  # the process-wide group (set_group)
_local = threading.local()  # .group: this thread's lane (tp.lane), over _group


def _current() -> _Group:
    lane_group: _Group | None = getattr(_local, "group", None)
    return lane_group or _group


# -- the group -----------------------------------------------------------------------------


def set_group(group: Any, rank: int, size: int, timeout_s: float = DEFAULT_TIMEOUT_S,
              describe: Describe | None = None) -> None:
    """Make `group` (this process is its `rank`-th of `size` members) the tensor-parallel
    group; `describe(collective, timed_out, reason)` words the error of a failed wait."""
    global _group
    if size < 1 or not 0 <= rank < size:
        raise PipelineError(f"tp.set_group: rank {rank} is not in a group of {size}: give 0 <= rank < size.")
    _group = _Group(group, int(rank), int(size), float(timeout_s), describe)


def reset() -> None:
    """Back to no group (and this thread to no lane): every function is the identity again."""
    global _group
    _group = _Group()
    _local.group = None


@contextlib.contextmanager
def lane(lanes: Lanes, index: int) -> Iterator[None]:
    """Within: this thread is lane `index` of the in-process group `lanes` ([Note: lanes] in lanes.py)."""
    if not 0 <= index < lanes.size:
        raise PipelineError(f"tp.lane: lane {index} is not in a group of {lanes.size}: give 0 <= index < size.")
    old = getattr(_local, "group", None)
    _local.group = _Group(rank=int(index), size=lanes.size, timeout_s=lanes.timeout_s, lanes=lanes)
    lanes.take_turn(index)
    try:
        yield
    finally:
        lanes.give_turn(index, done=True)
        _local.group = old


def rank() -> int:
    """This process's (or lane's) index in its tensor-parallel group (0 with no group)."""
    return _current().rank


def size() -> int:
    """The tensor-parallel group's size (1 with no group)."""
    return _current().size


def _active() -> bool:
    return _current().size > 1


@contextlib.contextmanager
def rank_stream(device: torch.device, training: bool = True) -> Iterator[None]:
    """Within (in training, with a group): random draws from this rank's own stream, for a
    dropout of a value sharded across the group ([Note: dropout streams] in modes.py).
    One number is drawn from the shared stream, the same on every rank, and the body runs
    under torch's generators (CPU and `device`'s) seeded by it mixed with the rank."""
    g = _current()
    if g.size == 1 or not training:
        yield
        return
    shared = int(torch.randint(2**62, (1,)))
    with modes.seeded(modes.mix(shared, g.rank), device):
        yield


def _doing(g: _Group, collective: str) -> Callable[[bool, str], str]:
    if g.describe is not None:
        return functools.partial(g.describe, collective)
    return functools.partial(_default_describe, g, collective)


def _default_describe(g: _Group, collective: str, timed_out: bool, reason: str) -> str:
    me = dist.get_rank() if dist.is_initialized() else "?"
    return (f"rank {me} (tp index {g.rank}) {'timed out' if timed_out else 'failed'} in {collective}: another "
            f"rank of its tensor-parallel group stopped or failed ({reason}). Look at that rank's own error; if it "
            f"is only slow, raise PIPELINE_TIMEOUT_S (now {g.timeout_s:g} s).")


# -- shards (no communication) ------------------------------------------------------------


def local_shard(x: torch.Tensor, dim: int, index: int, count: int, blocks: int = 1) -> torch.Tensor:
    """Shard `index` of `count` of x along `dim`: with `blocks` b, piece `index` of each of
    the b equal blocks, concatenated (a view when b is 1)."""
    dim = dim % x.dim()
    n = x.shape[dim]
    if n % (count * blocks):
        raise PipelineError(f"dimension {dim} of a tensor of shape {list(x.shape)} does not split into {blocks} "
                            f"block(s) x {count} tensor-parallel shards: compile the model again for this shape.")
    piece, block = n // (count * blocks), n // blocks
    if blocks == 1:
        return x.narrow(dim, index * piece, piece)
    return torch.cat([x.narrow(dim, j * block + index * piece, piece) for j in range(blocks)], dim=dim)


def join_shards(parts: list[torch.Tensor], dim: int, blocks: int = 1) -> torch.Tensor:
    """The inverse of `local_shard`: the whole tensor from every shard, in index order."""
    if blocks == 1:
        return torch.cat(parts, dim=dim)
    dim = dim % parts[0].dim()
    if parts[0].shape[dim] % blocks:
        raise PipelineError(f"a shard of shape {list(parts[0].shape)} does not split into {blocks} blocks along "
                            f"dimension {dim}: compile the model again.")
    pieces = [p.chunk(blocks, dim=dim) for p in parts]
    return torch.cat([pieces[r][j] for j in range(blocks) for r in range(len(parts))], dim=dim)


# -- the collectives, each waited with the timeout ----------------------------------------


def _sum(g: _Group, x: torch.Tensor, collective: str) -> torch.Tensor:
    """A fresh tensor: x summed over the group."""
    if g.lanes is not None:
        return g.lanes.exchange(g.rank, x.detach(), collective, _add_in_order)
    buf = x.detach().clone(memory_format=torch.contiguous_format)
    doing = _doing(g, collective)
    with guard(doing):
        work = dist.all_reduce(buf, group=g.handle, async_op=True)
    wait(work, g.timeout_s, doing)
    return buf


def _add_in_order(parts: list[torch.Tensor]) -> torch.Tensor:
    total = parts[0] + parts[1]
    for p in parts[2:]:
        total += p
    return total.contiguous()


def _gather(g: _Group, x: torch.Tensor, dim: int, blocks: int, collective: str) -> torch.Tensor:
    """Every rank's x joined along `dim` (block-major with `blocks`)."""
    if g.lanes is not None:
        return g.lanes.exchange(g.rank, x.detach(), collective, lambda parts: join_shards(parts, dim, blocks))
    mine = x.detach().contiguous()
    parts = [torch.empty_like(mine) for _ in range(g.size)]
    doing = _doing(g, collective)
    with guard(doing):
        work = dist.all_gather(parts, mine, group=g.handle, async_op=True)
    wait(work, g.timeout_s, doing)
    return join_shards(parts, dim, blocks)


def _mine(g: _Group, x: torch.Tensor, dim: int, blocks: int) -> torch.Tensor:
    """This rank's shard of x, as a fresh contiguous tensor."""
    return local_shard(x, dim, g.rank, g.size, blocks).clone(memory_format=torch.contiguous_format)


# Each forward reads the calling thread's group and keeps it in ctx for the backward.


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return _sum(_current(), x, "the tensor-parallel all_reduce")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.group = _current()
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return _sum(ctx.group, grad, "the tensor-parallel all_reduce of tp.copy's backward")


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, blocks: int) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.blocks = _current(), dim, blocks
        return _gather(ctx.group, x, dim, blocks, "the tensor-parallel all_gather")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _mine(ctx.group, grad, ctx.dim, ctx.blocks), None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, blocks: int) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.blocks = _current(), dim, blocks
        return _mine(ctx.group, x, dim, blocks)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        doing = "the tensor-parallel all_gather of tp.scatter's backward"
        return _gather(ctx.group, grad, ctx.dim, ctx.blocks, doing), None, None


def _reduce_scatter(g: _Group, x: torch.Tensor, dim: int, blocks: int, collective: str) -> torch.Tensor:
    """This rank's shard of x summed over the group: every rank's shard flattened into one
    contiguous chunk of a buffer, so one reduce_scatter serves any dim and blocks (lanes:
    the in-order sum, then this lane's shard)."""
    if g.lanes is not None:
        return _mine(g, g.lanes.exchange(g.rank, x.detach(), collective, _add_in_order), dim, blocks)
    shards = [local_shard(x.detach(), dim, r, g.size, blocks) for r in range(g.size)]
    flat = torch.cat([t.reshape(-1) for t in shards])
    out = torch.empty(shards[0].numel(), dtype=x.dtype, device=x.device)
    doing = _doing(g, collective)
    with guard(doing):
        work = dist.reduce_scatter_tensor(out, flat, group=g.handle, async_op=True)
    wait(work, g.timeout_s, doing)
    return out.view(shards[0].shape)


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, blocks: int) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.blocks = _current(), dim, blocks
        return _reduce_scatter(ctx.group, x, dim, blocks, "the tensor-parallel reduce_scatter")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        doing = "the tensor-parallel all_gather of tp.reduce_scatter's backward"
        return _gather(ctx.group, grad, ctx.dim, ctx.blocks, doing), None, None


# -- what generated code calls --------------------------------------------------------------


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Forward: x summed over the group; backward: the gradient unchanged (Megatron's g)."""
    return _AllReduce.apply(x) if _active() else x  # type: ignore[no-any-return]


def copy(x: torch.Tensor) -> torch.Tensor:
    """Forward: x unchanged; backward: the gradient summed over the group (Megatron's f)."""
    return _Copy.apply(x) if _active() else x  # type: ignore[no-any-return]


def all_gather(x: torch.Tensor, dim: int, blocks: int = 1) -> torch.Tensor:
    """Forward: every rank's x joined along `dim` in rank order (with `blocks` b: block 0 of
    every rank, then block 1, ...; the inverse of `scatter`); backward: this rank's slice."""
    return _AllGather.apply(x, dim, blocks) if _active() else x  # type: ignore[no-any-return]


def scatter(x: torch.Tensor, dim: int, blocks: int = 1) -> torch.Tensor:
    """Forward: this rank's shard of x along `dim` (piece rank() of each of `blocks` blocks);
    backward: the gradient all-gathered the same way."""
    return _Scatter.apply(x, dim, blocks) if _active() else x  # type: ignore[no-any-return]


def reduce_scatter(x: torch.Tensor, dim: int, blocks: int = 1) -> torch.Tensor:
    """Forward: this rank's shard (along `dim`, as `scatter` cuts) of x summed over the group
    (half an all_reduce's traffic); backward: the gradient all-gathered."""
    return _ReduceScatter.apply(x, dim, blocks) if _active() else x  # type: ignore[no-any-return]


def first_rank(x: torch.Tensor) -> torch.Tensor:
    """x on the group's first rank and zeros on the others (x * 0, so every rank's graph
    still reads x and its backward collectives run everywhere): a bias added to a
    partial sum once."""
    return x * float(_current().rank == 0) if _active() else x


def vocab_shard(ids: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For a vocabulary-parallel embedding whose local weight holds rows
    [rank() * rows, (rank() + 1) * rows): (ids made local, 0 where outside; outside)."""
    start = _current().rank * rows
    outside = (ids < start) | (ids >= start + rows)
    return (ids - start).masked_fill(outside, 0), outside
