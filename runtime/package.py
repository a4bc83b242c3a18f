"""Read a generated package DIR: manifest, stage modules, weights, microbatches, the loss.

Everything here reads only `manifest.json` (as `runtime.manifest.Manifest`), the stage
files and the package's copy of the model file (runtime.model_file): a rank needs torch alone.

[Note: shards]
    A parameter entry's `shape` is the LOCAL shape, the one the stage's __init__ makes.
    Its `shard` (`manifest.Shard`) is dim, index, count, blocks (optional, 1): count 1 (dim null,
    index 0) is the whole tensor; count T > 1 is one of T tensor-parallel shards along
    `dim`, and index "tp" means "this rank's tensor-parallel index", so one stage file and
    one manifest serve every rank of the group.  The whole tensor is `count` times longer
    along `dim`; with blocks b it is b equal blocks (a fused qkv weight: b = 3), and shard
    i is piece i of every block, concatenated (tp.local_shard, tp.join_shards).
"""

from __future__ import annotations

import copy
import dataclasses
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Iterable, Mapping, Union

import torch
import torch.utils._pytree as pytree

from . import tp
from .errors import BatchError, ManifestError, StateDictError
from .manifest import FORMAT_VERSION, BufferSpec, Manifest, ModelInput, ParamSpec, StageOutput, StageSpec, TensorSpec
from .model_file import import_file as _import_file
from .model_file import load_loss_fn, load_model_file

__all__ = [
    "FORMAT_VERSION",
    "load_manifest",
    "import_stage",
    "load_model_file",
    "load_loss_fn",
    "model_file_of",
    "kept_module",
    "stage_tensors",
    "check_state_dict",
    "KeyMismatch",
    "key_mismatch",
    "few",
    "load_stage_state",
    "assemble_state_dict",
    "split_inputs",
    "split_target",
    "microbatch_rows",
    "replica_rows",
    "loss_scales",
    "value_shape",
    "edge_values",
    "edge_grads",
    "dtype_of",
]

_model_files: dict[Path, types.ModuleType] = {}
_models: dict[Path, torch.nn.Module] = {}
Held = Union[ParamSpec, BufferSpec]  # a stage tensor's manifest entry


# -- manifest ------------------------------------------------------------------------------


def load_manifest(directory: str | Path) -> Manifest:
    """The parsed and checked manifest.json of package `directory`."""
    path = Path(directory)
    recompile = "compile the model again with `python -m partitioner compile MODEL.py --out DIR`"
    if not path.is_dir():
        raise ManifestError(f"package directory {str(directory)!r} does not exist (or is not a directory): {recompile}.")
    file = path / "manifest.json"
    if not file.is_file():
        raise ManifestError(f"{file} is missing, so {directory} is not a compiled package: {recompile}.")
    try:
        text = file.read_text()
    except UnicodeDecodeError as exc:
        raise ManifestError(f"{file} is corrupt (not JSON: {exc}): {recompile}.") from None
    return Manifest.from_json(text, origin=str(file))


# -- modules -------------------------------------------------------------------------------


def import_stage(directory: str | Path, manifest: Manifest, index: int) -> torch.nn.Module:
    """A fresh instance of stage `index`, imported from its own file only."""
    entry = manifest.stages[index]
    path = Path(directory).resolve() / f"{entry.module}.py"
    if not path.is_file():
        raise ManifestError(f"stage {index}'s file {path} is missing: compile the model again.")
    module = _import_file(path, f"_pipeline_{(manifest.hash or 'pkg')[:12]}_{entry.module}")
    cls = getattr(module, entry.class_name, None)
    if cls is None:
        raise ManifestError(f"{path} defines no class {entry.class_name!r}, which the manifest names: compile the model again.")
    stage = cls()
    if not isinstance(stage, torch.nn.Module):
        raise ManifestError(f"{path}: {entry.class_name} is not a torch.nn.Module.")
    return stage  # type: ignore[no-any-return]


def model_file_of(stage_file: str) -> types.ModuleType:
    """The model file the package holding `stage_file` was compiled from, imported once per
    package: a stage that calls the user's own code (a custom autograd Function, a module
    kept whole) reads it from there, so every stage shares the same classes."""
    directory = Path(stage_file).resolve().parent
    if directory not in _model_files:
        _model_files[directory] = load_model_file(load_manifest(directory), directory)
    return _model_files[directory]


def kept_module(stage_file: str, path: str) -> torch.nn.Module:
    """A fresh copy of the user's submodule `path` (a module the compiler kept whole): the
    model built once per package by the model file's entry (`manifest.source`), with the
    caller's RNG left as it was; its weights are the stage's, passed at each call."""
    directory = Path(stage_file).resolve().parent
    if directory not in _models:
        source = load_manifest(directory).source
        build = getattr(model_file_of(stage_file), source.entry)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(source.seed)
            _models[directory] = build()
    return copy.deepcopy(_models[directory].get_submodule(path))


# -- weights -------------------------------------------------------------------------------


def stage_tensors(module: torch.nn.Module, entry: StageSpec, tp_rank: int = 0) -> list[tuple[Held, torch.Tensor]]:
    """(manifest entry, tensor) for every parameter and persistent buffer of one stage.

    A sharded parameter's entry is a copy whose `shard.index` "tp" (this rank's
    tensor-parallel index, see [Note: shards]) is resolved to `tp_rank`."""
    out = []
    for spec in _held(entry):
        tensor = getattr(module, spec.name, None)
        if not isinstance(tensor, torch.Tensor):
            raise ManifestError(f"stage {entry.index} ({entry.class_name}) has no tensor attribute {spec.name!r} "
                                f"for {spec.source_name}: compile the model again.")
        out.append((_resolve(spec, tp_rank), tensor))
    return out


def _held(entry: StageSpec) -> list[Held]:
    """A stage's parameters and persistent buffers: what the state_dict holds of it."""
    return [*entry.parameters, *(b for b in entry.buffers if b.persistent)]


def _resolve(spec: Held, tp_rank: int) -> Held:
    """`spec`, or a copy whose shard index "tp" is `tp_rank` ([Note: shards])."""
    if isinstance(spec, ParamSpec) and spec.shard.index == "tp":
        return dataclasses.replace(spec, shard=dataclasses.replace(spec.shard, index=tp_rank))
    return spec


def _expected_keys(manifest: Manifest) -> dict[str, list[str]]:
    """canonical source name -> every original state_dict key that may hold it."""
    keys: dict[str, list[str]] = {}
    for stage in manifest.stages:
        for spec in _held(stage):
            keys.setdefault(spec.source_name, [spec.source_name])
    for alias, canonical in manifest.state_dict_aliases.items():
        if canonical in keys:
            keys[canonical].append(alias)
    return keys


@dataclass(frozen=True)
class KeyMismatch:
    """The original model's names absent from a set of keys, and the keys it does not have."""

    missing: list[str]
    unexpected: list[str]

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected)

    def describe(self, unit: str = "") -> str:
        """`missing N<unit>: a, b; unexpected M<unit>: c`."""
        parts = [f"missing {len(self.missing)}{unit}: {few(self.missing)}"] if self.missing else []
        parts += [f"unexpected {len(self.unexpected)}{unit}: {few(self.unexpected)}"] if self.unexpected else []
        return "; ".join(parts)


def key_mismatch(present: Collection[str], manifest: Manifest, strict: bool = True) -> KeyMismatch:
    """The keys `present` against the original model's state_dict keys (aliases allowed;
    missing names only count when `strict`).  Every reader of whole-model weights checks
    them here: load_state_dict, checkpoints, weights files."""
    keys = _expected_keys(manifest)
    allowed = {k for names in keys.values() for k in names}
    missing = sorted(c for c, names in keys.items() if not any(n in present for n in names)) if strict else []
    return KeyMismatch(missing, sorted(k for k in present if k not in allowed))


def check_state_dict(state_dict: Mapping[str, Any], manifest: Manifest) -> None:
    """Raise unless `state_dict` has exactly the original model's keys (aliases allowed)."""
    wrong = key_mismatch(state_dict.keys(), manifest)
    if wrong:
        raise StateDictError(f"the state_dict does not match the package ({wrong.describe(' key(s)')}): pass the ORIGINAL "
                             f"model's state_dict (build_model().state_dict()), or load_state_dict(sd, strict=False).")


def _layout(spec: Held) -> tuple[int, int, int, int]:
    """(dim, index, count, blocks) of a parameter's shard ([Note: shards]); count 1: whole.
    The index must be resolved already (`stage_tensors`)."""
    shard = spec.shard if isinstance(spec, ParamSpec) else None
    if shard is None or shard.count == 1:
        return 0, 0, 1, 1
    if not isinstance(shard.index, int) or shard.dim is None:
        raise ManifestError(f"{spec.source_name} ({spec.name}) has shard {shard}, which needs an integer 'dim' "
                            f"and an 'index' (an integer, or \"tp\" resolved by stage_tensors(..., tp_rank)): "
                            f"compile the model again.")
    return shard.dim, shard.index, shard.count, shard.blocks or 1


def load_stage_state(tensors: list[tuple[Held, torch.Tensor]], state_dict: Mapping[str, Any],
                     manifest: Manifest) -> None:
    """Copy each stage tensor's value (its shard when `shard.count` > 1) from the original
    state_dict; `tensors` as `stage_tensors` gives them (the shard index resolved); keys
    absent from `state_dict` are left as they are."""
    keys = _expected_keys(manifest)
    with torch.no_grad():
        for spec, tensor in tensors:
            name = next((n for n in keys[spec.source_name] if n in state_dict), None)
            if name is None:
                continue
            value = torch.as_tensor(state_dict[name])
            dim, index, count, blocks = _layout(spec)
            full = list(tensor.shape)
            if count > 1:
                full[dim] *= count
            if list(value.shape) != full:
                held = (f", of which each rank holds 1 of {count} tensor-parallel shards along dim {dim}: "
                        f"{list(tensor.shape)}" if count > 1 else "")
                raise StateDictError(f"state_dict[{name!r}] has shape {list(value.shape)} but the package expects "
                                     f"{full} (its {spec.name}{held}): load the state_dict of the model the "
                                     f"package was compiled from.")
            if count > 1:
                value = tp.local_shard(value, dim, index, count, blocks)
            tensor.copy_(value)


def assemble_state_dict(pieces: Iterable[tuple[Held, torch.Tensor]], manifest: Manifest) -> dict[str, torch.Tensor]:
    """The original model's state_dict from stage tensors (as `stage_tensors` gives them,
    from every tensor-parallel rank): shards joined, tied and replicated copies taken
    once, alias keys added."""
    shards: dict[str, dict[int, torch.Tensor]] = {}
    layouts: dict[str, tuple[int, int, int, int]] = {}
    for spec, tensor in pieces:
        layout = _layout(spec)
        shards.setdefault(spec.source_name, {}).setdefault(layout[1], tensor.detach())
        layouts[spec.source_name] = layout
    out: dict[str, torch.Tensor] = {}
    for name, parts in shards.items():
        dim, _, count, blocks = layouts[name]
        if count > 1:
            if sorted(parts) != list(range(count)):
                raise StateDictError(f"{name}: only shards {sorted(parts)} of {count} are present: gather the "
                                     f"stage tensors of every tensor-parallel rank.")
            out[name] = tp.join_shards([parts[i] for i in range(count)], dim, blocks)
        else:
            out[name] = parts[0]
    for alias, canonical in manifest.state_dict_aliases.items():
        if canonical in out:
            out[alias] = out[canonical]
    return out


def few(names: list[str]) -> str:
    """At most six names, then how many more."""
    return ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")


# -- values between stages ----------------------------------------------------------------


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


# -- microbatches --------------------------------------------------------------------------


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


def replica_rows(inputs: Any, manifest: Manifest) -> int | None:
    """The rows of one replica's share of `inputs` (None when no input has a batch
    dimension), which [Note: short batch] in counts.py fits the microbatch count to."""
    given = _by_key(inputs)
    for spec in manifest.inputs:
        value = _lookup(given, spec.key)
        if isinstance(value, torch.Tensor) and value.dim() > spec.batch_dim:
            share = _chunks(value, spec.batch_dim, 1, 0, manifest.mesh.dp, f"input {_key_text(spec.key)}")[0]
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


def loss_scales(rows: list[int], replicas: int = 1) -> list[float]:
    """What each microbatch's mean loss is divided by, so the sum over the microbatches (and
    `replicas` replicas of equal rows) is the whole batch's mean loss.

    [Note: microbatch weights]
        A batch of B rows is cut into dp replicas of B/dp rows (dp must divide B) and each
        replica into M microbatches by `torch.tensor_split` (the first (B/dp) % M are one row
        longer; M <= B/dp: the package's count, or fewer on a short batch, [Note: short batch]
        in counts.py).  Microbatch i's mean loss L_i over its r_i rows counts with
        weight r_i / B: sum_i (r_i / B) L_i is the mean over all B rows, exactly what
        `loss.backward()` on the whole batch differentiates.  With equal microbatches the
        divisor B / r_i is M x dp, as before.  LocalPipeline divides by B / r_i; a
        DistributedPipeline replica by (B/dp) / r_i, and the all-reduced loss (and the
        gradients' mean across replicas) by dp.
    """
    total = sum(rows) * replicas
    return [total / r for r in rows]


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


def split_inputs(inputs: Any, manifest: Manifest, replica: int = 0, count: int | None = None) -> list[dict[str, Any]]:
    """Microbatch i's model inputs, by manifest input name, for data-parallel `replica`.

    Each tensor is cut along its `batch_dim` (replica r takes rows [r*B/dp, (r+1)*B/dp),
    then `count` (default M) equal pieces); other values go to every microbatch unchanged.
    """
    m, dp = count or manifest.microbatches, manifest.mesh.dp
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
