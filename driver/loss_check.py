"""How the model file's `loss_fn` reduces over the batch, found on its example batch.

[Note: the loss's reduction]
    The runtime adds up the microbatches' losses, each divided as [Note: microbatch
    weights] in runtime/microbatches.py says: by B / r_i for a loss_fn that takes the mean
    over its rows (the contract's), by 1 for one that sums them (`reduction="sum"`).  Which
    one loss_fn is, the compile finds on the example batch of B rows, cut into the
    n = dp x M microbatches of `rows` rows the package runs (their order does not matter):

      the whole batch's loss = the mean of the n microbatches'  ->  "mean"
      the whole batch's loss = their sum                         ->  "sum", said in one line
      neither                                                     ->  ModelFileError

    and the manifest's `loss_reduction` records it ("sum" only; nothing is written for
    "mean").  A mean over tokens whose count differs between rows (cross_entropy with
    ignore_index=-100 on rows with different padding) is neither: each microbatch's loss is
    a mean over its own count, a count only loss_fn knows, so no weight per microbatch can
    make the whole batch's; it is refused with the fixes (a mean over rows, or a sum).  With
    n = 1 there is nothing to tell apart and "mean" stands.

    loss_fn is given microbatch 0's output, which the trace ran already (`propagate`'s
    value of each output leaf), repeated along each leaf's batch dimension for the whole
    batch (and for a pair of microbatches), against each piece's rows of the example
    target cut as the runtime cuts it (dim 0 of every tensor leaf): no model runs again,
    so neither dropout nor batch statistics nor a buffer's update can tell the pieces
    apart; only loss_fn's reduction does.  Leaves without a batch dimension (a scalar) are
    given whole to every piece, as the runtime's outputs hold them.  The losses are taken
    in float64 (equal to 1e-8 relative) where loss_fn runs on it, else in float32 (1e-4)
    or the output's own dtype (1e-2): sum and mean of n >= 2 pieces differ by a factor n.
    Where n copies of the output would be larger than `_WHOLE_BYTES`, consecutive pairs of
    microbatches are compared instead (each pair as a batch of its own), which holds a
    token-weighted mean to every piece all the same.  Where loss_fn cannot be run here
    (shape-only values on the meta device, a target without the batch's rows, loss_fn
    raising), nothing is found and "mean" stands: the runtime says what is wrong, if
    anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree

from partitioner.cost.nodes import is_shape_only
from partitioner.errors import ModelFileError
from partitioner.trace import model_file
from partitioner.trace.inputs import InputKey, output_batch_dims
from partitioner.trace.trace import Traced

__all__ = ["loss_reduction"]

#: the most bytes the whole batch's repeated output may take in float64 (else: pairs)
_WHOLE_BYTES = 256 * 2 ** 20
#: relative tolerance of "equal" by the dtype the losses were taken in
_RTOL = {torch.float64: 1e-8, torch.float32: 1e-4}
_RTOL_LOW = 1e-2

LossFn = Callable[[Any, Any], torch.Tensor]


def loss_reduction(mf: model_file.ModelFile, traced: Traced, values: dict[torch.fx.Node, Any],
                   dims: dict[InputKey, int], batch: int, rows: int, say: Callable[[str], None]) -> str:
    """"mean" or "sum": how the model file's loss_fn reduces over the example batch's `batch`
    rows cut into microbatches of `rows` ([Note: the loss's reduction]); `values`: one
    microbatch's value of every node, `dims`: the inputs' batch dims.  A ModelFileError
    where it is neither."""
    pieces = batch // rows if rows else 1
    if pieces < 2 or not (mf.has("loss_fn") and mf.has("example_target")):
        return "mean"
    leaves = [values.get(x, x) if isinstance(x, torch.fx.Node) else x for x in traced.output_leaves]
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    if not tensors or any(is_shape_only(t) for t in tensors):
        return "mean"
    out_dims = output_batch_dims(traced.output_leaves, rows, _input_dims(traced, dims))
    target = pytree.tree_map_only(torch.Tensor, lambda t: t.to(tensors[0].device), mf.example_target())
    if not _cut_alike(target, batch):
        return "mean"
    output = _Output(leaves, out_dims, traced.out_spec)
    whole = sum(t.numel() for t in tensors) * pieces * 8 <= _WHOLE_BYTES
    groups = [list(range(pieces))] if whole else [[i, i + 1] for i in range(pieces - 1)]
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        found = _found(mf.loss_fn(), output, target, groups, rows)
    if found is None:
        return "mean"
    reduction = _verdict(found, mf, pieces, rows, whole)
    if reduction == "sum":
        say(f"loss_fn sums over the batch (the example batch's loss is the sum of its {pieces} microbatches' "
            f"losses, not their mean): each microbatch's loss counts whole, so the pipeline trains on the whole "
            f"batch's sum as the original does")
    return reduction


def _input_dims(traced: Traced, dims: dict[InputKey, int]) -> dict[tuple[int, ...], int]:
    """Each input tensor's batch dim by its microbatch shape (as the package's inputs say)."""
    keys = dict(traced.input_keys)
    out: dict[tuple[int, ...], int] = {}
    for node in traced.gm.graph.nodes:
        meta = node.meta.get("tensor_meta") if node.op == "placeholder" else None
        if meta is not None and hasattr(meta, "shape") and node.name in keys:
            out[tuple(int(d) for d in meta.shape)] = dims.get(keys[node.name], 0)
    return out


def _cut_alike(target: Any, batch: int) -> bool:
    """Whether the runtime cuts `target` into microbatches: every tensor leaf with a
    dimension has the batch's rows along dim 0 (`runtime.microbatches.split_target`)."""
    return all(t.dim() == 0 or t.shape[0] == batch for t in pytree.tree_leaves(target) if isinstance(t, torch.Tensor))


class _Output:
    """Microbatch 0's output, repeated for a run of `count` microbatches."""

    def __init__(self, leaves: list[Any], dims: Sequence[int | None], spec: pytree.TreeSpec) -> None:
        self.leaves, self.dims, self.spec = leaves, dims, spec

    def of(self, count: int, dtype: torch.dtype | None) -> Any:
        """The output of `count` microbatches, its floating tensors in `dtype` (None: as they are)."""
        leaves = [self._repeated(leaf, self.dims[j] if j < len(self.dims) else 0, count, dtype)
                  for j, leaf in enumerate(self.leaves)]
        return pytree.tree_unflatten(leaves, self.spec)

    @staticmethod
    def _repeated(leaf: Any, dim: int | None, count: int, dtype: torch.dtype | None) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        if dtype is not None and leaf.is_floating_point():
            leaf = leaf.to(dtype)
        if dim is None or leaf.dim() == 0 or count == 1:
            return leaf
        return torch.cat([leaf] * count, dim=dim)


def _rows_of(target: Any, start: int, length: int) -> Any:
    """Rows [start, start + length) of every tensor leaf of `target` that has rows."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.narrow(0, start, length) if t.dim() else t, target)


def _found(loss_fn: LossFn, output: _Output, target: Any, groups: list[list[int]], rows: int) -> list[_Found] | None:
    """Each group of microbatches' losses, in the first dtype loss_fn runs on (float64,
    float32, the output's own); None where it runs on none of them."""
    for dtype in (torch.float64, torch.float32, None):
        try:
            return [_group(loss_fn, output, target, group, rows, dtype) for group in groups]
        except Exception:  # loss_fn may not take this dtype; the runtime says what else is wrong
            continue
    return None


def _group(loss_fn: LossFn, output: _Output, target: Any, group: list[int], rows: int,
           dtype: torch.dtype | None) -> _Found:
    """loss_fn on the group's microbatches together and on each alone."""
    whole = loss_fn(output.of(len(group), dtype), _rows_of(target, group[0] * rows, len(group) * rows))
    parts = [float(loss_fn(output.of(1, dtype), _rows_of(target, i * rows, rows)).reshape(())) for i in group]
    return _Found(float(whole.reshape(())), math.fsum(parts) / len(parts), math.fsum(parts),
                  _RTOL.get(whole.dtype, _RTOL_LOW))


def _verdict(found: list[_Found], mf: model_file.ModelFile, pieces: int, rows: int, whole: bool) -> str:
    """"mean" where every group's loss is its pieces' mean, else "sum" where every one's is
    their sum; a ModelFileError naming loss_fn, the numbers and the fix where neither."""
    if all(f.fits(f.mean) for f in found):
        return "mean"
    if all(f.fits(f.sum) for f in found):
        return "sum"
    bad = next((f for f in found if not f.fits(f.mean) and not f.fits(f.sum)), found[0])
    what = (f"the example batch cut into the package's {pieces} microbatches of {rows} rows" if whole else
            f"a pair of the package's microbatches of {rows} rows (of {pieces})")
    raise ModelFileError(
        f"{mf.path}: loss_fn is neither a mean nor a sum over the batch's rows: on {what}, the whole loss is "
        f"{bad.whole:.8g} but the microbatches' losses have mean {bad.mean:.8g} and sum {bad.sum:.8g}. The "
        f"pipeline adds up the microbatches' losses, so it would train a different loss. A mean over tokens whose "
        f"count differs between rows does this (cross_entropy with ignore_index=-100 on rows with different "
        f"padding): return a mean over rows (each row's mean over its real tokens, then .mean()), or a sum "
        f"(reduction=\"sum\", divided by a constant if you like), which the compile finds and trains exactly.")


@dataclass(frozen=True)
class _Found:
    """One group of microbatches' losses: together, and their mean and sum alone; `rtol`:
    how close counts as equal in the dtype they were taken in."""

    whole: float
    mean: float
    sum: float
    rtol: float

    def fits(self, value: float) -> bool:
        return abs(self.whole - value) <= self.rtol * max(abs(self.whole), abs(value))
