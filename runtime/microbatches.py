"""A batch cut into replicas and microbatches (inputs by path, targets, rows, loss weights),
and the microbatch outputs joined back into the whole batch's."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from .errors import BatchError, PipelineError
from .manifest import Manifest, ModelInput

__all__ = ["replica_rows", "microbatch_rows", "loss_scales", "split_inputs", "split_target", "concat_outputs"]


def _by_key(inputs: Any) -> dict[Any, Any]:
    """The batch's top-level values by position or keyword."""
    if isinstance(inputs, dict):
        return dict(inputs)
    if isinstance(inputs, torch.Tensor):
        return {0: inputs}
    if isinstance(inputs, (tuple, list)):
        return dict(enumerate(inputs))
    raise BatchError(f"inputs must be a tuple of positional arguments, a dict of keyword arguments or a tensor, "
                     f"as example_inputs() returns; got {type(inputs).__name__}.")


_ABSENT = object()


def _lookup(given: dict[Any, Any], key: Any) -> Any:
    """The batch's value at an input's key: a position or keyword, or a path into a nested
    input ([Note: input leaves] in partitioner/trace/inputs.py); `_ABSENT` where it has none."""
    path = key if isinstance(key, tuple) else (key,)
    value: Any = given
    for step in path:
        try:
            value = value[step]
        except (KeyError, IndexError, TypeError):
            return _ABSENT
    return value


def _key_text(key: Any) -> str:
    """An input's key as the model file's BATCH_DIMS writes it: `0`, `'x'`, `'hidden.0'`."""
    return ".".join(map(str, key)) if isinstance(key, tuple) else repr(key)


def _chunks(value: torch.Tensor, dim: int, m: int, replica: int, replicas: int, what: str) -> list[torch.Tensor]:
    """Replica `replica`'s rows of `value` along `dim`, cut into `m` microbatches
    ([Note: microbatch weights])."""
    if value.dim() <= dim:
        raise BatchError(f"{what} has shape {list(value.shape)}, with no batch dimension {dim}.")
    rows = value.shape[dim]
    if rows % replicas:
        raise BatchError(f"{what} has {rows} rows along its batch dimension {dim}, which do not split evenly across "
                         f"{replicas} data-parallel replicas: give a batch of a multiple of {replicas} rows (drop or "
                         f"pad the last batch), or compile with a --dp that divides it.")
    per = rows // replicas
    if per < m:
        raise BatchError(f"{what} has {rows} rows along its batch dimension {dim}: {per} per replica cannot fill "
                         f"{m} microbatches: give at least {m * replicas} rows, or compile with fewer --microbatches.")
    return list(torch.tensor_split(value.narrow(dim, replica * per, per), m, dim=dim))


def replica_rows(inputs: Any, manifest: Manifest, replicas: int | None = None) -> int | None:
    """The rows of one replica's share of `inputs` (None when no input has a batch
    dimension), which [Note: short batch] in counts.py fits the microbatch count to;
    `inputs` hold `replicas` replicas' rows (default: the package's dp; 1: local rows)."""
    given = _by_key(inputs)
    for spec in manifest.inputs:
        value = _lookup(given, spec.key)
        if isinstance(value, torch.Tensor) and value.dim() > spec.batch_dim:
            share = _chunks(value, spec.batch_dim, 1, 0, replicas or manifest.mesh.dp, f"input {_key_text(spec.key)}")[0]
            return share.shape[spec.batch_dim]
    return None


def microbatch_rows(inputs: Any, manifest: Manifest, count: int | None = None) -> list[int]:
    """The rows of each microbatch of one replica, as `split_inputs` cuts `inputs` into
    `count` microbatches (default: the package's)."""
    m = count or manifest.microbatches
    rows = replica_rows(inputs, manifest)
    if rows is None:
        rows = (manifest.batch_size or manifest.microbatches * manifest.mesh.dp) // manifest.mesh.dp
    if rows < m:
        raise BatchError(f"a replica's {rows} rows cannot fill {m} microbatches: give at least "
                         f"{m * manifest.mesh.dp} rows, or compile with fewer --microbatches.")
    return [p.numel() for p in torch.tensor_split(torch.empty(rows), m)]


def loss_scales(rows: list[int], replicas: int = 1, reduction: str = "mean", dp: int | None = None) -> list[float]:
    """What each microbatch's loss is divided by, so the sum over the microbatches (and
    `replicas` replicas of equal rows, of `dp`, default `replicas`) is the whole batch's
    loss: its mean, or with `reduction` "sum" its sum.

    [Note: microbatch weights]
        A batch of B rows is cut into dp replicas of B/dp rows (dp must divide B) and each
        replica into M microbatches by `torch.tensor_split` (the first (B/dp) % M are one row
        longer; M <= B/dp: the package's count, or fewer on a short batch, [Note: short batch]
        in counts.py).  Microbatch i's mean loss L_i over its r_i rows counts with
        weight r_i / B: sum_i (r_i / B) L_i is the mean over all B rows, exactly what
        `loss.backward()` on the whole batch differentiates.  With equal microbatches the
        divisor B / r_i is M x dp, as before.  LocalPipeline divides by B / r_i; a
        DistributedPipeline replica by (B/dp) / r_i, and the all-reduced loss (and the
        gradients' mean across replicas) by dp.  Given each replica's own rows (local=True),
        which may differ, a replica divides by B / (dp r_i): [Note: local rows] in
        local_rows.py.
        A loss_fn that sums over its rows (the manifest's `loss_reduction` "sum", found by the
        compile on the example batch: driver/loss_check.py) has the whole batch's loss
        sum_i L_i, each microbatch's counting whole: LocalPipeline divides by 1, a
        DistributedPipeline replica by 1/dp (the mean across replicas then leaves the sum),
        whatever the rows.
    """
    if reduction == "sum":
        return [replicas / (dp or replicas)] * len(rows)
    total = sum(rows) * replicas
    return [total / r for r in rows]


def split_inputs(inputs: Any, manifest: Manifest, replica: int = 0, count: int | None = None,
                 replicas: int | None = None) -> list[dict[str, Any]]:
    """Microbatch i's model inputs, by manifest input name, for data-parallel `replica`.

    Each tensor is cut along its `batch_dim` (replica r takes rows [r*B/dp, (r+1)*B/dp),
    then `count` (default M) equal pieces); other values go to every microbatch unchanged.
    `replicas` (default: the package's dp) is how many replicas' rows `inputs` hold: 1 for
    one replica's local rows ([Note: local rows] in local_rows.py).
    """
    m, dp = count or manifest.microbatches, replicas or manifest.mesh.dp
    given = _by_key(inputs)
    out: list[dict[str, Any]] = [{} for _ in range(m)]
    for spec in manifest.inputs:
        key = _key_text(spec.key)
        value = _lookup(given, spec.key)
        if value is _ABSENT:
            have = ", ".join(repr(k) for k in given) or "nothing"
            raise BatchError(f"the package reads input {key} ({spec.name}) but the batch has {have}: pass the "
                             f"inputs as the model file's example_inputs() gives them, nested inputs included.")
        if not isinstance(value, torch.Tensor):
            for mb in out:
                mb[spec.name] = value
            continue
        pieces = _chunks(value, spec.batch_dim, m, replica, dp, f"input {key}")
        for piece in pieces:
            _check_shape(piece, spec, manifest, key)
        for mb, piece in zip(out, pieces):
            mb[spec.name] = piece
    return out


def _check_shape(piece: torch.Tensor, spec: ModelInput, manifest: Manifest, key: str) -> None:
    """A microbatch's shape must be the compiled one, but for the batch dimension when it is free."""
    if spec.shape is None:
        return
    got, want = list(piece.shape), list(spec.shape)
    free = "batch" in manifest.free_dims
    if free and len(got) == len(want):
        got[spec.batch_dim] = want[spec.batch_dim]
    if got != want:
        m, dp = manifest.microbatches, manifest.mesh.dp
        fixed = ("only its batch dimension is free: the others (sequence length included) are the example "
                 "batch's" if free else f"its batch is fixed at {manifest.batch_size} rows (the model's sizes do "
                 f"not follow the batch)")
        raise BatchError(f"input {key} gives microbatches of shape {list(piece.shape)} but the package was "
                         f"compiled for {list(spec.shape)} ({m} microbatches x {dp} replica(s) of the example batch), "
                         f"and {fixed}: train on batches shaped like example_inputs(), or compile again.")


def split_target(target: Any, microbatches: int, replica: int = 0, replicas: int = 1,
                 batch_size: int | None = None) -> list[Any]:
    """Microbatch i's target: every tensor leaf cut along dim 0 (a tensor or a tuple of
    them); with `batch_size`, each leaf must have that many rows."""
    leaves, spec = pytree.tree_flatten(target)
    for x in leaves:
        if batch_size is not None and isinstance(x, torch.Tensor) and x.dim() and x.shape[0] != batch_size:
            raise BatchError(f"the target has {x.shape[0]} rows along dim 0 but the inputs have {batch_size}: "
                             f"give one target row per example, as example_target() does.")
    cut = [_chunks(x, 0, microbatches, replica, replicas, "the target") if isinstance(x, torch.Tensor) else [x] * microbatches
           for x in leaves]
    return [pytree.tree_unflatten([c[i] for c in cut], spec) for i in range(microbatches)]


def concat_outputs(outputs: list[Any], dims: tuple[int | None, ...] = ()) -> Any:
    """Microbatch outputs joined leaf by leaf: tensors concatenated along their batch
    dimension (`dims`, in pytree order, the manifest's `output_batch_dims`; dim 0 where it
    says nothing), scalar tensors averaged (mean-reduced values), other leaves taken from the
    first."""
    if not outputs:
        raise PipelineError("no microbatch produced an output.")
    flat = [pytree.tree_flatten(o)[0] for o in outputs]
    spec = pytree.tree_flatten(outputs[0])[1]
    leaves = [_join(column, dims[j] if j < len(dims) else 0) for j, column in enumerate(zip(*flat))]
    return pytree.tree_unflatten(leaves, spec)


def _join(column: tuple[Any, ...], dim: int | None) -> Any:
    """One output leaf of every microbatch as the whole batch's."""
    first = column[0]
    if isinstance(first, torch.Tensor) and first.dim() > 0 and dim is not None:
        return torch.cat([c.to(first.device) for c in column], dim=dim)
    if isinstance(first, torch.Tensor) and first.dim() == 0:
        return torch.stack([c.to(first.device) for c in column]).mean()
    return first
