"""The package's manifest.json as types: the one contract between codegen and the runtime.

The runtime owns the format it reads: codegen builds these dataclasses and calls
`Manifest.to_json`; every reader calls `Manifest.from_json` (a package folder's through
`read_manifest`), which checks the whole file once and raises a `ManifestError`
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
from pathlib import Path
from typing import Any, Mapping

from ._fields import _array, _Bad, _count, _int, _ints, _is_int, _key, _mapping, _Obj, _opt_int, _opt_ints_list, _opt_str, _shape, _str, _strs
from .errors import ManifestError
from .precision import PRECISIONS
from .predicted import Predicted, StagePrediction, _predicted
from .schedule.registry import SCHEDULES
from .stage_spec import (REPLICATED_SHARD, BufferSpec, ParamSpec, Shard, StageInput, StageOutput, StageSpec, TensorSpec,
                         _list, _stage)

__all__ = [
    "FORMAT_VERSION",
    "LOSS_REDUCTIONS",
    "SCHEDULES",
    "Manifest",
    "read_manifest",
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
LOSS_REDUCTIONS = ("mean", "sum")  # the manifest's `loss_reduction` ([Note: microbatch weights] in microbatches.py)
_RECOMPILE = "compile the model again"
_RECOMPILE_WITH = "compile the model again with `python -m partitioner compile MODEL.py --out DIR`"
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
    """pp pipeline positions x tp tensor-parallel ranks x dp replicas, and where each rank sits.

    [Note: rank layout]
        Global rank = (replica * pp + position) * tp + t, so the ranks of a tensor-parallel
        group are neighbours (as Megatron places them on one NVLink island); stage s sits
        at position `StageGraph.rank_of(s)` (s % pp, or a V under zb-v).  Codegen writes each
        stage's `ranks` by this rule and the runtime creates its groups by it.
    """

    pp: int
    tp: int = 1
    dp: int = 1

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> Mesh:
        """The manifest's own mesh (kept for callers that build it from the manifest)."""
        return manifest.mesh

    @property
    def world(self) -> int:
        return self.pp * self.tp * self.dp

    def rank(self, replica: int, position: int, t: int) -> int:
        """The global rank of (replica, position, t): [Note: rank layout]."""
        return (replica * self.pp + position) * self.tp + t

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(replica, position, t) of a global rank: [Note: rank layout]."""
        return rank // (self.tp * self.pp), rank // self.tp % self.pp, rank % self.tp

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
class TiedParameter:
    """A parameter of the original model held by several stages (tied embeddings)."""

    source_name: str
    stages: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"source_name": self.source_name, "stages": list(self.stages)}


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
    #: how loss_fn reduces over the batch, as the compile found it on the example batch
    #: ([Note: microbatch weights] in microbatches.py): "mean" or "sum", written only when "sum"
    loss_reduction: str = "mean"
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
            **({"loss_reduction": self.loss_reduction} if self.loss_reduction != "mean" else {}),
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


def read_manifest(directory: str | Path) -> Manifest:
    """The parsed and checked manifest.json of package `directory`: the one reader of a
    package folder's manifest (the CLI's, the driver's, the benchmarks')."""
    path = Path(directory)
    if not path.is_dir():
        raise ManifestError(f"{directory} is not a package directory: package directory {str(directory)!r} does not "
                            f"exist (or is a file); compile one with `python -m partitioner compile MODEL.py --out "
                            f"{directory}`.")
    file = path / "manifest.json"
    if not file.is_file():
        raise ManifestError(f"{directory} has no manifest.json: {file} is missing, so {directory} is not a compiled "
                            f"package; {_RECOMPILE_WITH}.")
    try:
        text = file.read_text()
    except UnicodeDecodeError as exc:
        raise ManifestError(f"{file} is corrupt (not JSON: {exc}): {_RECOMPILE_WITH}.") from None
    return Manifest.from_json(text, origin=str(file))


# -- reading: every field checked once, errors that name it -------------------------------


def _parse(data: str | Mapping[str, Any], origin: str) -> Mapping[str, Any]:
    recompile = _RECOMPILE_WITH
    if isinstance(data, str):
        try:
            data = json.loads(data)
        except ValueError as exc:
            raise ManifestError(f"{origin} is corrupt (not JSON: {exc}): {recompile}.") from None
    if not isinstance(data, Mapping):
        raise ManifestError(f"{origin} is corrupt (a JSON {type(data).__name__}, not an object): {recompile}.")
    if "format_version" not in data:
        raise ManifestError(f"{origin} is corrupt: it has no 'format_version' field; {_RECOMPILE}.")
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


def _tied(o: _Obj) -> TiedParameter:
    return TiedParameter(o.get("source_name", _str), tuple(o.get("stages", _ints)))


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
        precision=m.get("precision", _precision, "fp32"), loss_reduction=m.get("loss_reduction", _reduction, "mean"),
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


def _reduction(value: Any, path: str) -> str:
    if value not in LOSS_REDUCTIONS:
        raise _Bad(f"{path}: expected one of {', '.join(LOSS_REDUCTIONS)} (how loss_fn reduces over the batch), "
                   f"got {value!r}")
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
