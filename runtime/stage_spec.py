"""One stage's entries in manifest.json as types: the values crossing its boundaries, its
parameters and buffers (and their shards), and the stage itself, each with its reader.

`runtime.manifest` holds the whole manifest and reads it through these; they are
re-exported there, where the rest of the runtime imports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from .recompute import POLICIES, parse_policy
from ._fields import _bool, _check, _count, _from, _index, _int, _ints, _Obj, _opt_int, _opt_str, _shape, _str, _strs, _to, _Bad

__all__ = [
    "TensorSpec",
    "StageInput",
    "StageOutput",
    "Shard",
    "REPLICATED_SHARD",
    "ParamSpec",
    "BufferSpec",
    "StageSpec",
]


@dataclass(frozen=True)
class TensorSpec:
    """A value crossing a stage boundary: name, shape per microbatch, dtype."""

    name: str
    shape: tuple[int, ...] | None
    dtype: str | None


@dataclass(frozen=True)
class StageInput(TensorSpec):
    """A stage input; `source` (JSON "from") is the producing stage, or "input" (the batch)."""

    source: int | Literal["input"] = "input"
    requires_grad: bool = False
    batch_dim: int | None = None  # written only when set: see Manifest.free_dims

    @property
    def from_batch(self) -> bool:
        return self.source == "input"

    def to_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "shape": _list(self.shape), "dtype": self.dtype, "from": self.source,
               "requires_grad": self.requires_grad}
        return out if self.batch_dim is None else {**out, "batch_dim": self.batch_dim}


@dataclass(frozen=True)
class StageOutput(TensorSpec):
    """A stage output; `to` lists the reading stages, or is "output" (the model's output)."""

    to: tuple[int, ...] | Literal["output"] = "output"
    requires_grad: bool = True
    batch_dim: int | None = None  # written only when set: see Manifest.free_dims

    def to_dict(self) -> dict[str, Any]:
        to = self.to if self.to == "output" else list(self.to)
        out = {"name": self.name, "shape": _list(self.shape), "dtype": self.dtype, "to": to,
               "requires_grad": self.requires_grad}
        return out if self.batch_dim is None else {**out, "batch_dim": self.batch_dim}


@dataclass(frozen=True)
class Shard:
    """Which piece of the whole tensor a parameter holds: see [Note: shards] in package.py."""

    dim: int | None = None
    index: int | Literal["tp"] = 0
    count: int = 1
    blocks: int | None = None  # written only when set (codegen sets it on sharded parameters)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dim": self.dim, "index": self.index, "count": self.count}
        return out if self.blocks is None else {**out, "blocks": self.blocks}


REPLICATED_SHARD = Shard()


@dataclass(frozen=True)
class ParamSpec:
    """A stage parameter: its attribute `name`, its `source_name` in the original model and
    its LOCAL shape (a shard's, when `shard.count` > 1)."""

    name: str
    source_name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    requires_grad: bool = True
    shard: Shard = REPLICATED_SHARD

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "source_name": self.source_name, "shape": list(self.shape), "dtype": self.dtype,
                "requires_grad": self.requires_grad, "shard": self.shard.to_dict()}


@dataclass(frozen=True)
class BufferSpec:
    """A stage buffer; persistent ones are in the state_dict, `meta` ones have no values."""

    name: str
    source_name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    persistent: bool = True
    meta: bool = False  # written only when True

    def to_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "source_name": self.source_name, "shape": list(self.shape), "dtype": self.dtype,
               "persistent": self.persistent}
        return {**out, "meta": True} if self.meta else out


@dataclass(frozen=True)
class StageSpec:
    """One stage: its file `module`.py defines `class_name` (JSON "class"); `ranks` are the
    global ranks that run it."""

    index: int
    module: str
    class_name: str
    ranks: tuple[int, ...]
    inputs: tuple[StageInput, ...]
    outputs: tuple[StageOutput, ...]
    parameters: tuple[ParamSpec, ...]
    buffers: tuple[BufferSpec, ...] = ()
    nodes: int = 0
    modules: tuple[str, ...] = ()
    recompute: str | None = None  # "full" | "selective", written only when set ([Note: recomputation policies])
    offload: float = 0.0  # the fraction of its saved activations offloaded ([Note: activation
    #                       offloading] in offload.py); written only when above 0

    @property
    def is_last(self) -> bool:
        return bool(self.outputs) and self.outputs[0].to == "output"

    def to_dict(self) -> dict[str, Any]:
        out = {"index": self.index, "module": self.module, "class": self.class_name, "ranks": list(self.ranks),
               "inputs": [e.to_dict() for e in self.inputs], "outputs": [e.to_dict() for e in self.outputs],
               "parameters": [p.to_dict() for p in self.parameters], "buffers": [b.to_dict() for b in self.buffers],
               "nodes": self.nodes, "modules": list(self.modules)}
        out = {**out, "recompute": self.recompute} if self.recompute else out
        return {**out, "offload": self.offload} if self.offload > 0 else out



def _list(shape: tuple[int, ...] | None) -> list[int] | None:
    return None if shape is None else list(shape)



# -- reading: every field checked once, errors that name it -------------------------------


def _stage_input(o: _Obj) -> StageInput:
    return StageInput(o.get("name", _str), o.get("shape", _shape), o.get("dtype", _opt_str), o.get("from", _from),
                      o.get("requires_grad", _bool, False), o.get("batch_dim", _opt_int, None))


def _stage_output(o: _Obj) -> StageOutput:
    to = o.get("to", _to)
    return StageOutput(o.get("name", _str), o.get("shape", _shape), o.get("dtype", _opt_str),
                       to if to == "output" else tuple(to), o.get("requires_grad", _bool, False),
                       o.get("batch_dim", _opt_int, None))


def _shard(o: _Obj) -> Shard:
    shard = Shard(o.get("dim", _opt_int, None), o.get("index", _index, 0), o.get("count", _count, 1),
                  o.get("blocks", _count, None))
    if shard.count > 1 and shard.dim is None:
        raise _Bad(f"{o.path}.dim: expected an int (the shard has count {shard.count}), got None")
    return shard


def _param(o: _Obj) -> ParamSpec:
    shard = o.obj("shard", _shard) if o.data.get("shard") is not None else REPLICATED_SHARD
    return ParamSpec(o.get("name", _str), o.get("source_name", _str), tuple(o.get("shape", _ints)),
                     o.get("dtype", _str, "float32"), o.get("requires_grad", _bool, True), shard)


def _buffer(o: _Obj) -> BufferSpec:
    return BufferSpec(o.get("name", _str), o.get("source_name", _str), tuple(o.get("shape", _ints)),
                      o.get("dtype", _str, "float32"), o.get("persistent", _bool, True), o.get("meta", _bool, False))


def _policy(value: Any, path: str) -> str | None:
    """A stage's `recompute`: "full" | "selective" (an old package's `true` is "full")."""
    if not isinstance(value, (bool, str)) or isinstance(value, str) and value not in POLICIES:
        raise _Bad(f"{path}: expected one of {', '.join(POLICIES)} (or true), got {value!r}")
    return parse_policy(value)


def _stage(o: _Obj) -> StageSpec:
    return StageSpec(o.get("index", _int), o.get("module", _str), o.get("class", _str), tuple(o.get("ranks", _ints)),
                     o.each("inputs", _stage_input), o.each("outputs", _stage_output),
                     o.each("parameters", _param), o.each("buffers", _buffer, optional=True),
                     o.get("nodes", _int, 0), tuple(o.get("modules", _strs, [])), o.get("recompute", _policy, None),
                     float(o.get("offload", _fraction, 0.0)))


_fraction = _check("a fraction from 0 to 1 (of the stage's saved activations offloaded)",
                   lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1)


