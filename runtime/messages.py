"""One message per pipeline hand-over: the values an edge carries, packed into one buffer.

[Note: one message per hand-over]
    The values a stage edge carries for one microbatch travel as one message: their
    bytes, each at an ALIGN-byte offset, in one uint8 buffer; a lone value goes as it
    is.  A post and a gloo rendezvous per value cost more than the copy, and on a busy
    CPU back-to-back posts on one pair stall for milliseconds (the record:
    docs/notes/messages-on-cpu.md).

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
