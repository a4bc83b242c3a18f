"""Tensor-parallel collectives: what generated stage code calls (`from runtime import tp`).

Megatron-LM (Shoeybi et al., 2019, arXiv:1909.08053, section 3) splits a layer over the T
ranks of a tensor-parallel group with operations that come in conjugate pairs: the
backward of each one is the forward of its partner, so gradients stay exact.

    tp.copy(x)             forward: identity               backward: all_reduce (sum)   Megatron's f
    tp.all_reduce(x)       forward: all_reduce (sum)       backward: identity           Megatron's g
    tp.scatter(x, dim)     forward: this rank's shard      backward: all_gather
    tp.all_gather(x, dim)  forward: every shard, in order  backward: this rank's shard

A column-parallel linear (weight rows split) reads `tp.copy(x)` and ends with its output
sharded (or `tp.all_gather`ed); a row-parallel linear (weight columns split) ends with
`tp.all_reduce` of its partial sums.  Every value outside those regions is replicated:
each rank of the group computes it identically, so a replicated parameter's gradient
is the same everywhere without further communication.

`blocks=b` splits a fused dimension (a qkv weight's 3C rows) as b equal blocks, each cut
in T shards: rank r holds piece r of every block, concatenated.

`tp.set_group` is called by the runtime.  With no group set (or a group of one), every
function returns its input, so a tp=1 run and a plain import cost nothing.  Every
collective is posted asynchronously and waited with a timeout: a dead or silent peer
raises `PeerError` naming the collective, never hangs (comm.wait).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from .comm import DEFAULT_TIMEOUT_S, guard, wait
from .errors import PipelineError

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
    "local_shard",
    "join_shards",
]

Describe = Callable[[str, bool, str], str]  # (collective, timed out?, reason) -> the PeerError message


@dataclass(frozen=True)
class _Group:
    handle: Any = None  # a torch.distributed group; None is the default (world) group
    rank: int = 0
    size: int = 1
    timeout_s: float = DEFAULT_TIMEOUT_S
    describe: Describe | None = None


_group = _Group()


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
    """Back to no group: every function is the identity again."""
    global _group
    _group = _Group()


def rank() -> int:
    """This process's index in its tensor-parallel group (0 with no group)."""
    return _group.rank


def size() -> int:
    """The tensor-parallel group's size (1 with no group)."""
    return _group.size


def _active() -> bool:
    return _group.size > 1


def _doing(collective: str) -> Callable[[bool, str], str]:
    return functools.partial(_group.describe or _default_describe, collective)


def _default_describe(collective: str, timed_out: bool, reason: str) -> str:
    me = dist.get_rank() if dist.is_initialized() else "?"
    return (f"rank {me} (tp index {_group.rank}) {'timed out' if timed_out else 'failed'} in {collective}: another "
            f"rank of its tensor-parallel group stopped or failed ({reason}). Look at that rank's own error; if it "
            f"is only slow, raise PIPELINE_TIMEOUT_S (now {_group.timeout_s:g} s).")


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


def _sum(x: torch.Tensor, collective: str) -> torch.Tensor:
    """A fresh tensor: x summed over the group."""
    buf = x.detach().clone(memory_format=torch.contiguous_format)
    doing = _doing(collective)
    with guard(doing):
        work = dist.all_reduce(buf, group=_group.handle, async_op=True)
    wait(work, _group.timeout_s, doing)
    return buf


def _gather(x: torch.Tensor, dim: int, blocks: int, collective: str) -> torch.Tensor:
    """Every rank's x joined along `dim` (block-major with `blocks`)."""
    mine = x.detach().contiguous()
    parts = [torch.empty_like(mine) for _ in range(_group.size)]
    doing = _doing(collective)
    with guard(doing):
        work = dist.all_gather(parts, mine, group=_group.handle, async_op=True)
    wait(work, _group.timeout_s, doing)
    return join_shards(parts, dim, blocks)


def _mine(x: torch.Tensor, dim: int, blocks: int) -> torch.Tensor:
    """This rank's shard of x, as a fresh contiguous tensor."""
    return local_shard(x, dim, _group.rank, _group.size, blocks).clone(memory_format=torch.contiguous_format)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return _sum(x, "the tensor-parallel all_reduce")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return _sum(grad, "the tensor-parallel all_reduce of tp.copy's backward")


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, blocks: int) -> torch.Tensor:
        ctx.dim, ctx.blocks = dim, blocks
        return _gather(x, dim, blocks, "the tensor-parallel all_gather")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _mine(grad, ctx.dim, ctx.blocks), None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, blocks: int) -> torch.Tensor:
        ctx.dim, ctx.blocks = dim, blocks
        return _mine(x, dim, blocks)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather(grad, ctx.dim, ctx.blocks, "the tensor-parallel all_gather of tp.scatter's backward"), None, None


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


def vocab_shard(ids: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For a vocabulary-parallel embedding whose local weight holds rows
    [rank() * rows, (rank() + 1) * rows): (ids made local, 0 where outside; outside)."""
    start = _group.rank * rows
    outside = (ids < start) | (ids >= start + rows)
    return (ids - start).masked_fill(outside, 0), outside
