"""A stage's weights against the original model's state_dict: its tensors, the keys, shards.

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

import dataclasses
from dataclasses import dataclass
from typing import Any, Collection, Iterable, Mapping, Union

import torch

from . import tp
from .errors import ManifestError, StateDictError
from .manifest import BufferSpec, Manifest, ParamSpec, StageSpec

__all__ = [
    "Held",
    "stage_tensors",
    "check_state_dict",
    "KeyMismatch",
    "key_mismatch",
    "few",
    "load_stage_state",
    "assemble_state_dict",
]

Held = Union[ParamSpec, BufferSpec]  # a stage tensor's manifest entry


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
