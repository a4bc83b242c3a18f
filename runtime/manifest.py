"""The package's manifest.json as types: the one contract between codegen and the runtime.

The runtime owns the format it reads: codegen builds these dataclasses and calls
`Manifest.to_json`; every reader calls `Manifest.from_json` (through
`package.load_manifest`), which checks the whole file once and raises a `ManifestError`
that names the field, then uses fields.  `to_json` writes the bytes codegen has always
written (key order, `indent=1`, fields that are written only when set: a stage's
`recompute`, a buffer's `meta`, a shard's `blocks`, the `tensor_parallel` block, `hash`).

Free-form blocks stay mappings, since a type would only restate them: `options` (the
compile options, echoed for the reader), `tensor_parallel` (the rule per split node, the
collectives: a report), `predicted.solver` and any extra `predicted` entries (`candidates`
of the mesh search).  What the runtime reads is typed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from ._fields import (_array, _Bad, _bool, _count, _from, _index, _int, _ints, _is_int, _key, _mapping, _number,
                      _Obj, _opt_int, _opt_ints_list, _opt_str, _shape, _str, _strs, _to)
from .errors import ManifestError
from .precision import PRECISIONS
from .schedule.registry import SCHEDULES

__all__ = [
    "FORMAT_VERSION",
    "SCHEDULES",
    "Manifest",
    "Source",
    "MODEL_COPY",
    "Mesh",
    "ModelInput",
    "TensorSpec",
    "StageInput",
    "StageOutput",
    "Shard",
    "ParamSpec",
    "BufferSpec",
    "StageSpec",
    "TiedParameter",
    "StagePrediction",
    "Predicted",
    "REPLICATED_SHARD",
]

FORMAT_VERSION = 1
_RECOMPILE = "compile the model again"
MODEL_COPY = "model_file.py"  # the package's copy of the model file ([Note: the model file's copy])


# -- the types -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """The model file the package was compiled from.

    [Note: the model file's copy]
        A package keeps a copy of its model file beside the stages (`copy`, the file
        `MODEL_COPY` in the package folder, whose sha256 is `sha256`), and everything that
        needs the model file's code (`loss_fn`, `init_weights`, `batches`, modules kept
        whole, classes a stage calls) imports that copy, so a package runs from any working
        directory and after the model file has moved.  `path` is the model file's base name
        alone: no path of the machine that compiled it is written, so two checkouts compile
        the same bytes.  The modules of the model file's own folder that it imports
        (`import gpt` beside gpt.py: partitioner/trace/siblings.py) are copied beside it
        under their own names (`modules`), and the package folder is on sys.path while the
        copy is imported; anything else it imports (a package folder, a module elsewhere) is
        found on `sys.path` (PYTHONPATH, or the working directory) when the package loads.
        A manifest without `copy` (compiled before) names the model file by the path given
        to the compile, looked up as it always was.
    """

    path: str
    sha256: str = ""
    entry: str = "build_model"
    seed: int = 0
    copy: str = ""  # the copy's file name in the package ("": none, an older package)
    modules: tuple[str, ...] = ()  # modules of the model file's folder it imports, copied beside it

    def to_dict(self) -> dict[str, Any]:
        copy = {"copy": self.copy} if self.copy else {}
        modules = {"modules": list(self.modules)} if self.modules else {}
        return {"path": self.path} | copy | modules | {"sha256": self.sha256, "entry": self.entry, "seed": self.seed}


@dataclass(frozen=True)
class Mesh:
    """pp pipeline positions x tp tensor-parallel ranks x dp replicas."""

    pp: int
    tp: int = 1
    dp: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {"pp": self.pp, "tp": self.tp, "dp": self.dp}


@dataclass(frozen=True)
class ModelInput:
    """One input of the model: its name in the graph, its key in the batch (a position or a
    keyword, or a path into a nested input: [Note: input leaves] in partitioner/trace/inputs.py),
    the dimension microbatches cut, and its shape per microbatch (None: not a tensor)."""

    name: str
    key: str | int | tuple[str | int, ...]
    batch_dim: int = 0
    shape: tuple[int, ...] | None = None
    dtype: str | None = None

    def to_dict(self) -> dict[str, Any]:
        key = list(self.key) if isinstance(self.key, tuple) else self.key
        return {"name": self.name, "key": key, "batch_dim": self.batch_dim, "shape": _list(self.shape),
                "dtype": self.dtype}


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
    recompute: bool = False  # written only when True

    @property
    def is_last(self) -> bool:
        return bool(self.outputs) and self.outputs[0].to == "output"

    def to_dict(self) -> dict[str, Any]:
        out = {"index": self.index, "module": self.module, "class": self.class_name, "ranks": list(self.ranks),
               "inputs": [e.to_dict() for e in self.inputs], "outputs": [e.to_dict() for e in self.outputs],
               "parameters": [p.to_dict() for p in self.parameters], "buffers": [b.to_dict() for b in self.buffers],
               "nodes": self.nodes, "modules": list(self.modules)}
        return {**out, "recompute": True} if self.recompute else out


@dataclass(frozen=True)
class TiedParameter:
    """A parameter of the original model held by several stages (tied embeddings)."""

    source_name: str
    stages: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"source_name": self.source_name, "stages": list(self.stages)}


@dataclass(frozen=True)
class StagePrediction:
    """What the compiler predicts for one stage, per microbatch (time) and at peak (memory)."""

    time_s: float
    memory_bytes: int
    compute_s: float = 0.0
    param_bytes: int = 0
    send_bytes: int = 0
    recv_bytes: int = 0
    peak_inflight: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"time_s": self.time_s, "compute_s": self.compute_s, "memory_bytes": self.memory_bytes,
                "param_bytes": self.param_bytes, "send_bytes": self.send_bytes, "recv_bytes": self.recv_bytes,
                "peak_inflight": self.peak_inflight}


@dataclass(frozen=True)
class Predicted:
    """The compiler's prediction of a training step; `solver` (the solver's report) and
    `extra` (further entries, e.g. the mesh search's `candidates`) are free-form."""

    step_time_s: float
    mfu: float
    stages: tuple[StagePrediction, ...]
    cost_source: str = ""
    hardware: str = ""
    solver: Mapping[str, Any] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"step_time_s": self.step_time_s, "mfu": self.mfu, "cost_source": self.cost_source,
                "hardware": self.hardware, "stages": [s.to_dict() for s in self.stages], "solver": dict(self.solver),
                **self.extra}

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> Predicted:
        """The block as the planner builds it (a dict), checked as `Manifest.from_json` checks it."""
        try:
            return _predicted(_Obj(data, "predicted"))
        except _Bad as bad:
            raise ManifestError(f"the predicted block is malformed: {bad}.") from None


@dataclass(frozen=True)
class Manifest:
    """The whole manifest.json of a package."""

    source: Source
    mesh: Mesh
    schedule: str
    microbatches: int
    inputs: tuple[ModelInput, ...]
    stages: tuple[StageSpec, ...]
    format_version: int = FORMAT_VERSION
    generator: str = ""
    tracer: str = ""
    options: Mapping[str, Any] = field(default_factory=dict)
    virtual_stages: int = 1
    batch_size: int | None = None
    #: the dimensions a batch may change ([Note: free batch]): () or ("batch",), written only
    #: when set.  With "batch", a value crossing stages whose `batch_dim` is set has, along
    #: it, its `shape` scaled by the microbatch's rows over the compiled rows.
    free_dims: tuple[str, ...] = ()
    #: each output leaf's batch dimension, in pytree order (None: not cut, e.g. a scalar);
    #: () means dim 0 for all, and it is written only when some leaf's is not 0
    output_batch_dims: tuple[int | None, ...] = ()
    #: `compile --precision` (runtime.precision), written only when not "fp32"
    precision: str = "fp32"
    tied_parameters: tuple[TiedParameter, ...] = ()
    state_dict_aliases: Mapping[str, str] = field(default_factory=dict)  # extra state_dict key -> canonical name
    meta_constants: tuple[str, ...] = ()
    tensor_parallel: Mapping[str, Any] = field(default_factory=dict)  # written only when not empty
    predicted: Predicted | None = None
    hash: str = ""  # written only when set: codegen hashes the manifest without it

    def to_dict(self) -> dict[str, Any]:
        """The JSON object, keys in the order codegen has always written them."""
        out: dict[str, Any] = {
            "format_version": self.format_version, "generator": self.generator, "source": self.source.to_dict(),
            "tracer": self.tracer, "options": dict(self.options), "mesh": self.mesh.to_dict(),
            "schedule": self.schedule, "microbatches": self.microbatches, "virtual_stages": self.virtual_stages,
            "batch_size": self.batch_size, **({"free_dims": list(self.free_dims)} if self.free_dims else {}),
            **({"output_batch_dims": list(self.output_batch_dims)} if self.output_batch_dims else {}),
            **({"precision": self.precision} if self.precision != "fp32" else {}),
            "inputs": [i.to_dict() for i in self.inputs],
            "stages": [s.to_dict() for s in self.stages],
            "tied_parameters": [t.to_dict() for t in self.tied_parameters],
            "state_dict_aliases": dict(self.state_dict_aliases), "meta_constants": list(self.meta_constants),
        }
        if self.tensor_parallel:
            out["tensor_parallel"] = dict(self.tensor_parallel)
        out["predicted"] = {} if self.predicted is None else self.predicted.to_dict()
        if self.hash:
            out["hash"] = self.hash
        return out

    def to_json(self) -> str:
        """manifest.json's text."""
        return json.dumps(self.to_dict(), indent=1) + "\n"

    @staticmethod
    def from_json(data: str | Mapping[str, Any], origin: str = "manifest.json") -> Manifest:
        """Read and check a manifest (its text or its parsed object); `origin` names it in
        errors.  Raises `ManifestError` naming the bad field and the fix."""
        try:
            return _read_manifest(_parse(data, origin))
        except _Bad as bad:
            raise ManifestError(f"{origin} is corrupt: {bad}; {_RECOMPILE}.") from None


def _list(shape: tuple[int, ...] | None) -> list[int] | None:
    return None if shape is None else list(shape)


# -- reading: every field checked once, errors that name it -------------------------------


def _parse(data: str | Mapping[str, Any], origin: str) -> Mapping[str, Any]:
    recompile = "compile the model again with `python -m partitioner compile MODEL.py --out DIR`"
    if isinstance(data, str):
        try:
            data = json.loads(data)
        except ValueError as exc:
            raise ManifestError(f"{origin} is corrupt (not JSON: {exc}): {recompile}.") from None
    if not isinstance(data, Mapping):
        raise ManifestError(f"{origin} is corrupt (a JSON {type(data).__name__}, not an object): {recompile}.")
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        raise ManifestError(f"{origin} has format_version {version!r} but this runtime reads format_version "
                            f"{FORMAT_VERSION}: compile the package with the same partitioner version as the runtime.")
    return data


def _source(o: _Obj) -> Source:
    return Source(o.get("path", _str), o.get("sha256", _str, ""), o.get("entry", _str, "build_model"),
                  o.get("seed", _int, 0), o.get("copy", _str, ""), tuple(o.get("modules", _strs, [])))


def _mesh(o: _Obj) -> Mesh:
    sizes: list[Any] = [o.data.get(k) for k in ("pp", "tp", "dp")]
    if not all(_is_int(v) and v >= 1 for v in sizes):
        raise _Bad("'mesh' needs positive integers 'pp', 'tp' and 'dp'")
    return Mesh(*sizes)


def _model_input(o: _Obj) -> ModelInput:
    return ModelInput(o.get("name", _str), o.get("key", _key), o.get("batch_dim", _int, 0),
                      o.get("shape", _shape, None), o.get("dtype", _opt_str, None))


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


def _stage(o: _Obj) -> StageSpec:
    return StageSpec(o.get("index", _int), o.get("module", _str), o.get("class", _str), tuple(o.get("ranks", _ints)),
                     o.each("inputs", _stage_input), o.each("outputs", _stage_output),
                     o.each("parameters", _param), o.each("buffers", _buffer, optional=True),
                     o.get("nodes", _int, 0), tuple(o.get("modules", _strs, [])), o.get("recompute", _bool, False))


def _tied(o: _Obj) -> TiedParameter:
    return TiedParameter(o.get("source_name", _str), tuple(o.get("stages", _ints)))


def _stage_prediction(o: _Obj) -> StagePrediction:
    return StagePrediction(o.get("time_s", _number), o.get("memory_bytes", _int), o.get("compute_s", _number, 0.0),
                           o.get("param_bytes", _int, 0), o.get("send_bytes", _int, 0), o.get("recv_bytes", _int, 0),
                           o.get("peak_inflight", _int, 0))


def _predicted(o: _Obj) -> Predicted:
    known = ("step_time_s", "mfu", "cost_source", "hardware", "stages", "solver")
    return Predicted(o.get("step_time_s", _number), o.get("mfu", _number), o.each("stages", _stage_prediction),
                     o.get("cost_source", _str, ""), o.get("hardware", _str, ""), o.get("solver", _mapping, {}),
                     {k: v for k, v in o.data.items() if k not in known})


def _read_manifest(data: Mapping[str, Any]) -> Manifest:
    m = _Obj(data, "")
    for key in ("source", "mesh", "schedule", "microbatches", "stages", "inputs"):
        m.get(key, lambda v, _: v)
    schedule, stages = m.get("schedule", _str), m.get("stages", _array)
    if schedule not in SCHEDULES:
        raise _Bad(f"schedule {schedule!r} is none of {', '.join(SCHEDULES)}")
    if not _is_int(m.data["microbatches"]) or m.data["microbatches"] < 1:
        raise _Bad("'microbatches' must be a positive integer")
    if not stages:
        raise _Bad("'stages' must be a non-empty list")
    predicted = m.data.get("predicted")
    manifest = Manifest(
        source=m.obj("source", _source), mesh=m.obj("mesh", _mesh), schedule=schedule,
        microbatches=m.data["microbatches"], inputs=m.each("inputs", _model_input), stages=m.each("stages", _stage),
        format_version=FORMAT_VERSION, generator=m.get("generator", _str, ""), tracer=m.get("tracer", _str, ""),
        options=m.get("options", _mapping, {}), virtual_stages=m.get("virtual_stages", _count, 1),
        batch_size=m.get("batch_size", _opt_int, None), free_dims=tuple(m.get("free_dims", _free, [])),
        output_batch_dims=tuple(m.get("output_batch_dims", _opt_ints_list, [])),
        precision=m.get("precision", _precision, "fp32"),
        tied_parameters=m.each("tied_parameters", _tied, optional=True),
        state_dict_aliases=m.get("state_dict_aliases", _mapping, {}),
        meta_constants=tuple(m.get("meta_constants", _strs, [])),
        tensor_parallel=m.get("tensor_parallel", _mapping, {}),
        predicted=m.obj("predicted", _predicted) if predicted else None, hash=m.get("hash", _str, ""))
    _check_stages(manifest)
    return manifest


def _precision(value: Any, path: str) -> str:
    if value not in PRECISIONS:
        raise _Bad(f"{path}: expected one of {', '.join(PRECISIONS)} (the precisions this runtime runs), got {value!r}")
    return str(value)


def _free(value: Any, path: str) -> list[str]:
    names = _strs(value, path)
    if any(n != "batch" for n in names):
        raise _Bad(f"{path}: expected [] or [\"batch\"] (only the batch dimension is ever free), got {value!r}")
    return names


def _check_stages(m: Manifest) -> None:
    """What no single field shows: stage order, shard counts, tied copies, the stage count."""
    copies: dict[str, set[tuple[Any, ...]]] = {}
    for k, stage in enumerate(m.stages):
        if stage.index != k:
            raise _Bad(f"stage {k} has index {stage.index!r}")
        for p in stage.parameters:
            if p.shard.count not in (1, m.mesh.tp):
                raise _Bad(f"stage {k}'s {p.name!r} is cut in {p.shard.count} shards but mesh.tp is {m.mesh.tp}")
            copies.setdefault(p.source_name, set()).add((p.shape, _layout(p.shard)))
    odd = sorted(n for n, layouts in copies.items() if len(layouts) > 1)
    if odd:
        raise _Bad(f"the copies of tied parameter(s) {', '.join(odd)} differ in shape or shard")
    if len(m.stages) != m.mesh.pp * m.virtual_stages:
        raise _Bad(f"{len(m.stages)} stages is not mesh.pp ({m.mesh.pp}) x virtual_stages ({m.virtual_stages})")


def _layout(shard: Shard) -> tuple[Any, ...]:
    """A shard as its copies must agree on it: the whole tensor, or (dim, count, blocks)."""
    return (None, 1, 1) if shard.count == 1 else (shard.dim, shard.count, shard.blocks or 1)
