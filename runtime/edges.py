"""The values between stages: what an edge carries forward, what flows back, their shapes.

Sender and receiver derive the same lists from the manifest alone, so no shape or dtype
travels with a message ([Note: one message per hand-over] in messages.py).  `Edges` makes
each edge's lists once per package, and each shape once per microbatch size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import messages
from .errors import ManifestError
from .manifest import Manifest, ModelInput, StageOutput, TensorSpec
from .weights import Held

__all__ = ["dtype_of", "edge_values", "edge_grads", "value_shape", "Edge", "Edges"]


def dtype_of(spec: TensorSpec | ModelInput | Held) -> torch.dtype:
    """The torch dtype of a manifest value ("float32" -> torch.float32)."""
    dtype = getattr(torch, str(spec.dtype), None)
    if not isinstance(dtype, torch.dtype):
        raise ManifestError(f"value {spec.name!r} has dtype {spec.dtype!r}, which is not a torch dtype: compile again.")
    return dtype


def edge_values(manifest: Manifest, p: int, c: int) -> list[StageOutput]:
    """The outputs of stage p that stage c reads, in p's output order (sender and receiver agree)."""
    reads = {e.name for e in manifest.stages[c].inputs if e.source == p}
    return [o for o in manifest.stages[p].outputs if o.name in reads]


def edge_grads(manifest: Manifest, p: int, c: int) -> list[StageOutput]:
    """The values on edge p -> c whose gradient flows back from c to p."""
    needs = {e.name for e in manifest.stages[c].inputs if e.source == p and e.requires_grad}
    return [o for o in edge_values(manifest, p, c) if o.name in needs and o.requires_grad
            and (dtype_of(o).is_floating_point or dtype_of(o).is_complex)]


def value_shape(spec: TensorSpec, rows: int, manifest: Manifest) -> list[int]:
    """A value's shape for a microbatch of `rows` rows: the manifest's, with its
    `batch_dim` (when the batch is free, [Note: free batch]) scaled from the compiled rows."""
    assert spec.shape is not None, f"{spec.name} has no shape"
    shape = list(spec.shape)
    dim = getattr(spec, "batch_dim", None)
    if dim is not None and "batch" in manifest.free_dims:
        compiled = (manifest.batch_size or 0) // (manifest.microbatches * manifest.mesh.dp)
        if compiled:
            shape[dim] = shape[dim] // compiled * rows
    return shape


@dataclass(frozen=True)
class Edge:
    """What one hand-over on edge p -> c carries: p's values forward (`edge_values`), or their
    gradients back (`edge_grads`); the shapes of a microbatch of each size made once."""

    manifest: Manifest = field(repr=False)
    specs: tuple[StageOutput, ...]
    dtypes: tuple[torch.dtype, ...]
    _shapes: dict[int, list[list[int]]] = field(default_factory=dict, repr=False, compare=False)

    def shapes(self, rows: int) -> list[list[int]]:
        """Each value's shape for a microbatch of `rows` rows."""
        if rows not in self._shapes:
            self._shapes[rows] = [value_shape(spec, rows, self.manifest) for spec in self.specs]
        return self._shapes[rows]

    def message_bytes(self, rows: int) -> int:
        """The size of the packed message of several values ([Note: one message per hand-over])."""
        return messages.layout(self.shapes(rows), self.dtypes)[1]


class Edges:
    """Every edge's `Edge`, forward and backward, made once per package when first asked for."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self._made: dict[tuple[int, int, bool], Edge] = {}

    def get(self, p: int, c: int, forward: bool) -> Edge:
        """Edge p -> c: its values (`forward`) or the gradients flowing back on it."""
        key = (p, c, forward)
        if key not in self._made:
            specs = edge_values(self.manifest, p, c) if forward else edge_grads(self.manifest, p, c)
            self._made[key] = Edge(self.manifest, tuple(specs), tuple(dtype_of(s) for s in specs))
        return self._made[key]
