"""Packing an edge's values into one message (runtime/messages.py)."""

from __future__ import annotations

import pytest
import torch

from runtime import messages

VALUES = [
    torch.randn(3, 5),
    torch.tensor([[True, False, True, True]]).reshape(1, 1, 4),
    torch.tensor(7, dtype=torch.int64),
    torch.randn(7).half(),
    torch.randn(2, 3, dtype=torch.complex64),
    torch.randn(3).bfloat16(),
]


def test_values_come_back_bit_for_bit() -> None:
    buffer = messages.pack(VALUES)
    assert buffer.dtype == torch.uint8 and buffer.dim() == 1
    got = messages.unpack(buffer, [v.shape for v in VALUES], [v.dtype for v in VALUES])
    for want, have in zip(VALUES, got):
        assert have.dtype == want.dtype and have.shape == want.shape
        assert torch.equal(_raw(have), _raw(want))


def test_offsets_are_aligned_and_disjoint() -> None:
    offsets, size = messages.layout([v.shape for v in VALUES], [v.dtype for v in VALUES])
    ends = [o + v.numel() * v.dtype.itemsize for o, v in zip(offsets, VALUES)]
    assert all(o % messages.ALIGN == 0 for o in offsets)
    assert all(e <= o for e, o in zip(ends, offsets[1:])) and size == ends[-1]
    assert messages.pack(VALUES).numel() == size


def test_a_non_contiguous_value_is_packed_as_its_values() -> None:
    base = torch.arange(12.0).reshape(3, 4)
    (got,) = messages.unpack(messages.pack([base.t()]), [(4, 3)], [torch.float32])
    assert torch.equal(got, base.t())


def test_unpacked_values_share_the_buffer_but_not_a_version_counter() -> None:
    buffer = messages.pack([torch.ones(4), torch.ones(4)])
    a, b = messages.unpack(buffer, [(4,), (4,)], [torch.float32, torch.float32])
    start = buffer.data_ptr()
    assert start <= a.data_ptr() < b.data_ptr() < start + buffer.numel()  # no copy
    # a received value saved for backward, another changed in place by the stage
    x, y = a.detach().requires_grad_(True), b.detach()
    z = (x * x).sum()
    y.add_(1.0)
    z.backward()
    assert torch.equal(x.grad, 2 * torch.ones(4))


def test_plain_views_would_trip_autograd() -> None:
    # why unpack gives each value a version counter of its own
    buffer = torch.ones(8)
    x, y = buffer[:4].detach().requires_grad_(True), buffer[4:].detach()
    z = (x * x).sum()
    y.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward()


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)
