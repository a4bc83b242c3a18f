"""The pieces of global tensors one process holds, in the form torch.distributed.checkpoint reads and writes.

[Note: checkpoint chunks]
    A checkpoint is keyed by the ORIGINAL model's names with each tensor's FULL global
    shape (so `format_utils.dcp_to_torch_save` gives the original state_dict).  A rank
    holds, of each tensor, either all of it or its tensor-parallel shard ([Note: shards]
    in weights.py): shard i of T along `dim`; with b blocks (a fused qkv weight), piece i
    of every block, i.e. b separate boxes of the global tensor.  `Chunked` lists those
    boxes (global offsets, local view) and implements the three hooks DCP's planners call
    on a checkpointable tensor (`__create_write_items__`, `__create_chunk_list__`,
    `__get_tensor_shard__`), so DCP itself writes each box, deduplicates the boxes that
    several ranks hold (dp replicas, tied copies: same key, same offsets), checks that the
    boxes of all ranks tile each tensor, and on load reads only the parts of the stored
    boxes that overlap this rank's boxes: any plan reads any other plan's checkpoint.
    LocalPipeline's lanes are one process holding several boxes of one tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ..weights import Held, _layout
from ..manifest import ParamSpec

__all__ = ["Chunked", "boxes", "global_shape", "collect"]

Box = tuple[torch.Size, torch.Tensor]  # (global offsets, local view)


class Chunked(torch.Tensor):
    """The boxes of one global tensor of shape `size` that this process holds; only DCP's
    planner hooks use it (no tensor op runs on it)."""

    _boxes: list[Box]
    _copies: list[Box]  # further holders of a box already in _boxes (LocalPipeline's lanes)

    @staticmethod
    def __new__(cls, size: torch.Size, parts: list[Box]) -> Chunked:
        first = parts[0][1]
        out = torch.Tensor._make_wrapper_subclass(cls, size, dtype=first.dtype, device=first.device)
        out._boxes, out._copies = [], []
        out.hold(parts)
        return out  # type: ignore[no-any-return]

    def hold(self, parts: list[Box]) -> None:
        """Hold these boxes too: a box already held becomes a copy (written once, filled on load)."""
        have = {offsets for offsets, _ in self._boxes}
        for offsets, view in parts:
            (self._copies if offsets in have else self._boxes).append((offsets, view))
            have.add(offsets)
        self._boxes.sort(key=lambda box: tuple(box[0]))

    def fill_copies(self) -> None:
        """After a load: every copy takes its box's value."""
        first = dict(self._boxes)
        with torch.no_grad():
            for offsets, view in self._copies:
                if view is not first[offsets]:
                    view.copy_(first[offsets])

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        raise NotImplementedError(f"{func} on a checkpoint's Chunked view: it only carries boxes for DCP.")

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Chunked(size={list(self.shape)}, boxes={[list(o) for o, _ in self._boxes]})"

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets, view.size()),
                                                      properties=TensorProperties.create_from_tensor(view),
                                                      size=self.shape))
                for offsets, view in self._boxes]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets, view.size()) for offsets, view in self._boxes]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, view in self._boxes:
            if index.offset is None or offsets == index.offset:
                return view
        raise ValueError(f"{index.fqn}: this process holds no box at offsets {index.offset}")


def global_shape(spec: Held, local: torch.Size) -> torch.Size:
    """The whole tensor's shape, from a held tensor's local shape and its shard layout."""
    dim, _, count, _ = _layout(spec)
    full = list(local)
    if count > 1:
        full[dim] *= count
    return torch.Size(full)


def boxes(spec: Held, local: torch.Tensor) -> list[Box]:
    """The boxes of the global tensor that `local` (held as `spec` says) covers."""
    dim, index, count, blocks = _layout(spec)
    zero = [0] * local.dim()
    if count == 1:
        return [(torch.Size(zero), local)]
    dim = dim % local.dim()
    whole = global_shape(spec, local.shape)[dim]
    piece, block = local.shape[dim] // blocks, whole // blocks
    out = []
    for j in range(blocks):
        offsets = list(zero)
        offsets[dim] = j * block + index * piece
        out.append((torch.Size(offsets), local.narrow(dim, j * piece, piece)))
    return out


def collect(held: list[tuple[Held, torch.Tensor]]) -> dict[str, Chunked]:
    """source name -> the boxes of it these held tensors cover (each box once)."""
    found: dict[str, Chunked] = {}
    for spec, tensor in held:
        parts = boxes(spec, tensor.detach())
        if spec.source_name in found:
            found[spec.source_name].hold(parts)
        else:
            found[spec.source_name] = Chunked(global_shape(spec, tensor.shape), parts)
    return found


def is_sharded(spec: Held) -> bool:
    return isinstance(spec, ParamSpec) and _layout(spec)[2] > 1
