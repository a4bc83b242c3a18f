"""runtime/tp.py against single-process references, run on every rank of a 2-process gloo
group by dist_worker.py (MODE tp).  Every rank builds the same full tensors from one
seed, so the reference is computed locally; each check compares forward values and the
gradients autograd leaves, which must be EXACT (to float32 rounding)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from runtime import tp

RTOL, ATOL = 1e-5, 1e-6


def _close(got: torch.Tensor | None, want: torch.Tensor, what: str) -> None:
    """Equal to float32 rounding: a sum rounds relative to its largest terms, not to its
    result (an entry near 0 of a product of entries near 10 is off by ~1e-6 when a shard
    sums in another order), so the absolute tolerance grows with the largest magnitude."""
    assert got is not None, f"{what}: no gradient"
    atol = ATOL * max(1.0, float(want.detach().abs().max()))
    torch.testing.assert_close(got, want, rtol=RTOL, atol=atol, msg=lambda m: f"{what}: {m}")


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_(True)


def check_all_reduce_and_copy(r: int, n: int) -> None:
    g = torch.Generator().manual_seed(10)
    xs = [torch.randn(3, 4, generator=g) for _ in range(n)]
    ws = [torch.randn(3, 4, generator=g) for _ in range(n)]
    # all_reduce: forward sums, backward passes the gradient through
    x = _leaf(xs[r])
    y = tp.all_reduce(x)
    _close(y, sum(xs), "all_reduce forward")  # type: ignore[arg-type]
    (y * ws[r]).sum().backward()
    _close(x.grad, ws[r], "all_reduce backward")
    # copy: forward identity, backward sums; x itself is untouched
    x = _leaf(xs[0])
    y = tp.copy(x)
    _close(y, xs[0], "copy forward")
    (y * ws[r]).sum().backward()
    _close(x.grad, sum(ws), "copy backward")  # type: ignore[arg-type]


def check_column_and_row_parallel_linear(r: int, n: int) -> None:
    g = torch.Generator().manual_seed(11)
    x0, w1, b1, w2, b2, up = (torch.randn(*s, generator=g) for s in [(5, 8), (12, 8), (12,), (8, 12), (8,), (5, 8)])
    # the reference: two linears, one process
    ref = [_leaf(t) for t in (x0, w1, b1, w2, b2)]
    out = F.linear(F.gelu(F.linear(ref[0], ref[1], ref[2])), ref[3], ref[4])
    (out * up).sum().backward()
    # column-parallel fc1 (rows of w1, b1 scattered), row-parallel fc2 (columns of w2) + all_reduce
    full = [_leaf(t) for t in (x0, w1, b1, w2, b2)]
    x, w1_, b1_, w2_, b2_ = full
    h = F.gelu(F.linear(tp.copy(x), tp.scatter(w1_, 0), tp.scatter(b1_, 0)))  # (5, 12 / n)
    assert list(h.shape) == [5, 12 // n]
    y = tp.all_reduce(F.linear(h, tp.scatter(w2_, 1))) + b2_
    _close(y, out.detach(), "row-parallel output")
    (y * up).sum().backward()
    for name, a, b in zip(["x", "w1", "b1", "w2", "b2"], full, ref):
        _close(a.grad, b.grad, f"grad of {name}")  # type: ignore[arg-type]
    # column-parallel with its output gathered equals the whole linear
    x, w = _leaf(x0), _leaf(w1)
    y = tp.all_gather(F.linear(tp.copy(x), tp.scatter(w, 0)), -1)
    _close(y, F.linear(x0, w1), "all_gather of a column-parallel linear")
    y.pow(2).sum().backward()
    _close(w.grad, 2 * F.linear(x0, w1).t() @ x0, "grad of the column-parallel weight")
    _close(x.grad, 2 * F.linear(x0, w1) @ w1, "grad of the column-parallel input")


def check_blocks(r: int, n: int) -> None:
    full = torch.arange(4 * 12, dtype=torch.float32).reshape(4, 12)
    up = torch.linspace(-1, 1, 48).reshape(4, 12)
    x = _leaf(full)
    s = tp.scatter(x, 1, blocks=3)  # block j = columns [4j, 4j + 4): rank r keeps [4j + 2r, 4j + 2r + 2)
    want = torch.cat([full[:, 4 * j + 2 * r: 4 * j + 2 * r + 2] for j in range(3)], dim=1)
    _close(s, want, "scatter with blocks=3")
    back = tp.all_gather(s, 1, blocks=3)
    _close(back, full, "all_gather(scatter(x)) with blocks=3")
    (back * up).sum().backward()
    _close(x.grad, up, "grad through scatter and all_gather with blocks=3")
    # all_gather's backward is this rank's slice (no communication), per rank
    piece = _leaf(want)
    gathered = tp.all_gather(piece, 1, blocks=3)
    (gathered * up * (r + 1)).sum().backward()
    _close(piece.grad, tp.local_shard(up * (r + 1), 1, r, n, blocks=3), "all_gather backward with blocks=3")
    # shards on dim 0, odd shapes
    x = _leaf(torch.randn(6, 3, generator=torch.Generator().manual_seed(3)))
    _close(tp.all_gather(tp.scatter(x, 0), 0), x.detach(), "all_gather(scatter(x)) on dim 0")


def check_vocab_shard(r: int, n: int) -> None:
    ids = torch.tensor([[0, 3, 4], [7, 5, 1]])
    local, outside = tp.vocab_shard(ids, 4)
    start = 4 * r
    assert outside.dtype == torch.bool
    assert torch.equal(outside, (ids < start) | (ids >= start + 4)), outside
    assert torch.equal(local, torch.where(outside, 0, ids - start)), local
    # a vocabulary-parallel embedding equals the whole one, gradient included
    wte = torch.randn(4 * n, 5, generator=torch.Generator().manual_seed(4))
    w = _leaf(wte)
    emb = tp.all_reduce(F.embedding(local, tp.scatter(w, 0)).masked_fill(outside.unsqueeze(-1), 0.0))
    _close(emb, F.embedding(ids, wte), "vocabulary-parallel embedding")
    emb.sum().backward()
    ref = _leaf(wte)
    F.embedding(ids, ref).sum().backward()
    _close(w.grad, ref.grad, "grad of the vocabulary-parallel embedding")  # type: ignore[arg-type]


def check_partial_sums(r: int, n: int) -> None:
    """A row-parallel linear left as a partial sum, its bias added once (first_rank), then
    sharded by reduce_scatter: equal to the whole linear's shard, gradients exact."""
    g = torch.Generator().manual_seed(13)
    x0, w0, b0, up = (torch.randn(*s, generator=g) for s in [(6, 8), (4, 8), (4,), (6, 4)])
    ref = [_leaf(t) for t in (x0, w0, b0)]
    out = F.linear(*ref)
    (out * up).sum().backward()
    x, w, b = (_leaf(t) for t in (x0, w0, b0))
    partial = F.linear(tp.scatter(x, 1), tp.scatter(w, 1), tp.first_rank(tp.copy(b)))  # (6, 4): this rank's part
    y = tp.reduce_scatter(partial, 0)  # (6 / n, 4): rows of the sum
    _close(y, tp.local_shard(out.detach(), 0, r, n), "reduce_scatter of a partial sum")
    (y * tp.local_shard(up, 0, r, n)).sum().backward()
    for name, a, want in zip(["x", "w", "b"], (x, w, b), ref):
        _close(a.grad, want.grad, f"grad of {name} through reduce_scatter")  # type: ignore[arg-type]
    # any dimension, with blocks: each rank's shard flattened into one chunk of the buffer
    parts = [torch.randn(6, 4, generator=g) for _ in range(n)]
    got = tp.reduce_scatter(parts[r], 1, blocks=2)
    _close(got, tp.local_shard(sum(parts), 1, r, n, blocks=2), "reduce_scatter along dim 1 with blocks")  # type: ignore[arg-type]


def check_rank_and_size(r: int, n: int) -> None:
    assert (tp.rank(), tp.size()) == (r, n), (tp.rank(), tp.size())


def run(timeout_s: float) -> None:
    """Every check, on the world group as the tensor-parallel group."""
    r, n = dist.get_rank(), dist.get_world_size()
    tp.set_group(None, r, n, timeout_s)
    for check in (check_rank_and_size, check_all_reduce_and_copy, check_column_and_row_parallel_linear,
                  check_blocks, check_vocab_shard, check_partial_sums):
        check(r, n)
