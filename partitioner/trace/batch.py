"""The batch dimension left free: sizes that follow the microbatch's rows stay expressions.

[Note: free batch]
    The graph is traced for one microbatch of `rows` rows and every non-tensor value is
    folded to a constant (`passes.specialize`).  To let a package take a microbatch of any
    number of rows, the graph is also run on two probe microbatches (`rows + 1` and
    `rows + 3` rows, the example rows repeated) before the real run, and each folded value
    is compared across the three runs.  (A search's microbatch shapes copy one fx trace,
    so a shape reads two earlier shapes' runs, real or probe, by node name instead of
    running its own: `passes.probe`'s `seen`.)

    - an int that is the same in all three is a plain constant;
    - an int that follows `coef * rows + offset` exactly becomes a `BatchInt`: an int of
      the compiled value that remembers its formula, so the planner's passes (costs, tensor
      parallelism) read the compiled value while codegen writes `batch`, `4 * batch` or
      `batch + 1`, with `batch = x.shape[d]` read from a stage input at run time;
    - a tensor whose shape differs in exactly one dimension `d`, by `coef * rows`, gets
      `node.meta["batch_dim"] = (d, coef)`, which the manifest records for the values that
      cross stages so the runtime sizes its receive buffers from the actual microbatch.

    Anything else (a float computed from the batch size, a tensor whose size is not
    proportional to it, a probe run that fails, e.g. a model that writes its batch size as a
    literal) keeps the batch fixed: the package is specialised as before and its manifest
    lists no free dimension.  Only the batch is ever free: every other dimension, the
    sequence length included, is the example batch's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

__all__ = ["BatchInt", "FreeBatch", "PROBE_EXTRA", "batch_constant", "probe_batch", "resize_rows"]

#: the probe microbatches have rows + k rows, for each k here
PROBE_EXTRA = (1, 3)


class BatchInt(int):
    """An int that equals `coef * rows + offset` for the compiled microbatch's rows."""

    coef: int
    offset: int

    def __new__(cls, value: int, coef: int, offset: int) -> BatchInt:
        obj = super().__new__(cls, value)
        obj.coef, obj.offset = coef, offset
        return obj

    def __floordiv__(self, other: Any) -> Any:  # tensor parallelism divides sizes by tp
        value = int(self) // other
        if isinstance(other, int) and not isinstance(other, BatchInt) and self.coef % other == 0 \
                and self.offset % other == 0:
            return BatchInt(value, self.coef // other, self.offset // other)
        return value

    def __mul__(self, other: Any) -> Any:
        value = int(self) * other
        if isinstance(other, int) and not isinstance(other, BatchInt):
            return BatchInt(value, self.coef * other, self.offset * other)
        return value

    __rmul__ = __mul__

    def __reduce__(self) -> Any:
        return (BatchInt, (int(self), self.coef, self.offset))

    def __deepcopy__(self, memo: Any) -> BatchInt:
        return self

    def expr(self, name: str) -> str:
        """Python source for the value, with `name` standing for the microbatch's rows."""
        term = name if self.coef == 1 else f"{self.coef} * {name}"
        if self.offset == 0:
            return term
        return f"{term} + {self.offset}" if self.offset > 0 else f"{term} - {-self.offset}"


@dataclass
class FreeBatch:
    """The probe runs: rows of each (the compiled one first) and every node's value there."""

    rows: list[int]
    values: list[dict[torch.fx.Node, Any]]
    #: each tensor node's shape in each probe run
    shapes: list[dict[torch.fx.Node, tuple[int, ...]]]


class NotFree(Exception):
    """A value that does not follow the batch affinely: the batch stays fixed."""


def batch_constant(node: torch.fx.Node, value: Any, free: FreeBatch) -> Any:
    """`value` (folded from `node` at the compiled rows) with BatchInts where it follows the rows."""
    others = [_plain(v.get(node, _MISSING)) for v in free.values[1:]]
    if any(o is _MISSING for o in others):
        raise NotFree(f"{node.format_node()} did not run in every probe")
    leaves, spec = pytree.tree_flatten(value)
    columns = [pytree.tree_flatten(o) for o in others]
    if any(s != spec for _, s in columns):
        raise NotFree(f"{node.format_node()} changes structure with the batch size")
    out = []
    for j, leaf in enumerate(leaves):
        seen = [leaf] + [c[0][j] for c in columns]
        out.append(_fit(node, seen, free.rows))
    return pytree.tree_unflatten(out, spec)


def _fit(node: torch.fx.Node, seen: list[Any], rows: list[int]) -> Any:
    first = seen[0]
    if all(type(s) is type(first) and s == first for s in seen):
        return first
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in seen):
        raise NotFree(f"{node.format_node()} computes {type(first).__name__} values from the batch size ({seen})")
    coef, rem = divmod(seen[1] - seen[0], rows[1] - rows[0])
    offset = first - coef * rows[0]
    if rem or any(s != coef * r + offset for s, r in zip(seen, rows)):
        raise NotFree(f"{node.format_node()} is not an affine function of the batch size ({seen} at rows {rows})")
    return BatchInt(first, coef, offset)


def batch_dim(node: torch.fx.Node, free: FreeBatch) -> tuple[int, int] | None:
    """(dim, rows per microbatch row) of a tensor node whose size follows the batch, None
    for one that does not; raises NotFree for one that follows it some other way."""
    shapes = [s.get(node) for s in free.shapes]
    if any(s is None for s in shapes) or len({len(s) for s in shapes if s is not None}) != 1:
        raise NotFree(f"{node.format_node()} changes rank with the batch size")
    first = shapes[0]
    assert first is not None
    dims = [d for d in range(len(first)) if any(s[d] != first[d] for s in shapes if s is not None)]
    if not dims:
        return None
    d = dims[0]
    coef = first[d] // free.rows[0] if free.rows[0] else 0
    if len(dims) > 1 or any(s is None or s[d] != coef * r for s, r in zip(shapes, free.rows)):
        raise NotFree(f"{node.format_node()} has shapes {shapes} at rows {free.rows}: not proportional to the batch")
    return d, coef


def resize_rows(value: Any, dim: int, rows: int) -> Any:
    """`value` with `rows` rows along `dim`: its own rows repeated in turn (a probe batch)."""
    if not isinstance(value, torch.Tensor) or value.dim() <= dim:
        return value
    index = torch.arange(rows, device=value.device) % value.shape[dim]
    return value.index_select(dim, index)


def probe_batch(keyed: dict[Any, Any], batch_dims: dict[Any, int], rows: int) -> dict[Any, Any]:
    """The example microbatch (by input key: [Note: input leaves] in inputs.py) resized to `rows` rows."""
    return {k: resize_rows(v, batch_dims.get(k, 0), rows) for k, v in keyed.items()}


_MISSING = object()


def _plain(value: Any) -> Any:
    """torch.Size as the tuple it folds to (`passes._constant`), containers walked."""
    if isinstance(value, (torch.Size, tuple)):
        return tuple(_plain(v) for v in value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
