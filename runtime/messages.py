"""One message per pipeline hand-over: the values an edge carries, packed into one buffer.

[Note: one message per hand-over]
    A stage boundary often carries several values (a hidden state and its attention
    mask; NCF's two branches), and sending each with its own isend/irecv costs a post
    and a gloo rendezvous per value.  On the CPU that costs more than it looks: gloo's
    I/O thread shares the rank's core with the main thread, and when the peer's reply to
    one post wakes it while the main thread holds the pair's lock in the next post, it
    preempts the main thread and spins (`Pair::handleEvents` only tries the lock, and
    the socket stays readable, so epoll returns at once) until the scheduler's tick
    preempts it in turn: a 1-5 ms stall, both ranks often stuck at once (ftrace and perf
    of the NCF example on our 2-core VM).  Back-to-back posts on one pair make those
    collisions likely.  So an edge's values travel as one message: their bytes, each at
    an ALIGN-byte offset, in one uint8 buffer; a lone value goes as it is.  Sending NCF's
    two values as one made its 2-stage steps 0.73-0.86x as long, the Hugging Face
    models' (mask and hidden state) 0.78-1.02x (A/B in rounds at batch 24 and 192).

    The receiver's values are views of that buffer, each made a tensor of its own
    (`_alone`): views of one base share autograd's version counter, so an in-place op
    of the stage on one received value would otherwise fail the check on another.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

__all__ = ["ALIGN", "layout", "pack", "unpack"]

#: bytes each packed value's offset is a multiple of (any dtype's element size divides it)
ALIGN = 16


def layout(shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype]) -> tuple[list[int], int]:
    """The byte offset of each value in the packed buffer, and the buffer's size."""
    offsets, end = [], 0
    for shape, dtype in zip(shapes, dtypes):
        start = -(-end // ALIGN) * ALIGN
        offsets.append(start)
        end = start + math.prod(shape) * dtype.itemsize
    return offsets, end


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes in one flat uint8 tensor, at `layout`'s offsets."""
    offsets, size = layout([t.shape for t in tensors], [t.dtype for t in tensors])
    out = torch.empty(size, dtype=torch.uint8, device=tensors[0].device)
    for t, start in zip(tensors, offsets):
        raw = _bytes(t)
        out[start:start + raw.numel()].copy_(raw)
    return out


def unpack(buffer: torch.Tensor, shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype]) -> list[torch.Tensor]:
    """The values `pack` put in `buffer` (views of it, each with its own version counter)."""
    offsets, _ = layout(shapes, dtypes)
    out = []
    for shape, dtype, start in zip(shapes, dtypes, offsets):
        nbytes = math.prod(shape) * dtype.itemsize
        out.append(_alone(buffer[start:start + nbytes].view(dtype).view(tuple(shape))))
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _alone(view: torch.Tensor) -> torch.Tensor:
    """`view`'s memory as a tensor that is nobody's view (its own version counter)."""
    return torch.empty(0, dtype=view.dtype, device=view.device).set_(
        view.untyped_storage(), view.storage_offset(), view.shape, view.stride())
