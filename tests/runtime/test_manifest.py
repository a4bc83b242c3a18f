"""runtime/manifest.py: every golden manifest reads and writes back byte for byte; a bad
field is named in the error, with the fix."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Callable

import pytest

from runtime.errors import ManifestError
from runtime.groups import Mesh as GroupsMesh
from runtime.manifest import Manifest, Mesh, ParamSpec, Shard, StageInput, StageOutput, read_manifest

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
MANIFESTS = sorted(GOLDEN.glob("*/manifest.json"))


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.parent.name)
def test_golden_manifest_round_trips_byte_for_byte(path: Path) -> None:
    text = path.read_text()
    manifest = Manifest.from_json(text)
    assert manifest.to_json() == text
    assert Manifest.from_json(json.loads(text)) == manifest  # a parsed object reads the same


def test_fields_are_typed() -> None:
    m = Manifest.from_json((GOLDEN / "gpt_wide_2stages_tp2" / "manifest.json").read_text())
    assert (m.mesh.pp, m.mesh.tp, m.mesh.dp) == (2, 2, 1) and m.schedule in ("gpipe", "1f1b", "interleaved")
    first = m.stages[0]
    assert isinstance(first.inputs[0], StageInput) and first.inputs[0].from_batch
    assert isinstance(m.stages[-1].outputs[0], StageOutput) and m.stages[-1].is_last
    sharded = [p for s in m.stages for p in s.parameters if p.shard.count > 1]
    assert sharded and all(isinstance(p, ParamSpec) and p.shard.index == "tp" for p in sharded)
    assert m.predicted is not None and len(m.predicted.stages) == len(m.stages)
    assert Shard().count == 1 and Shard().to_dict() == {"dim": None, "index": 0, "count": 1}


def _set(path: list[Any], value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(m: dict[str, Any]) -> None:
        target: Any = m
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return edit


def _drop(path: list[Any]) -> Callable[[dict[str, Any]], None]:
    def edit(m: dict[str, Any]) -> None:
        target: Any = m
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]
    return edit


BAD = [
    (_set(["stages", 1, "parameters", 3, "shard", "dim"], "x"),
     r"stages\[1\]\.parameters\[3\]\.shard\.dim: expected an int or null, got 'x'"),
    (_set(["stages", 0, "inputs", 0, "shape"], [6, "8"]),
     r"stages\[0\]\.inputs\[0\]\.shape: expected a list of ints or null, got \[6, '8'\]"),
    (_set(["stages", 0, "outputs", 0, "to"], 1), r"stages\[0\]\.outputs\[0\]\.to: expected a list of stage indices or \"output\", got 1"),
    (_set(["inputs", 0, "batch_dim"], None), r"inputs\[0\]\.batch_dim: expected an int, got None"),
    (_set(["stages", 1, "parameters", 0, "requires_grad"], "yes"),
     r"stages\[1\]\.parameters\[0\]\.requires_grad: expected true or false, got 'yes'"),
    (_drop(["stages", 1, "parameters", 0, "source_name"]), r"stages\[1\]\.parameters\[0\] has no 'source_name' field"),
    (_drop(["stages", 1, "class"]), r"stage 1 has no 'class' field"),
    (_drop(["mesh"]), r"it has no 'mesh' field"),
    (_set(["schedule"], "zigzag"), r"schedule 'zigzag' is none of gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-v"),
    (_set(["mesh", "tp"], 0), r"'mesh' needs positive integers 'pp', 'tp' and 'dp'"),
    (_set(["stages", 1, "index"], 0), r"stage 1 has index 0"),
    (_set(["virtual_stages"], 2), r"2 stages is not mesh.pp \(2\) x virtual_stages \(2\)"),
]


@pytest.mark.parametrize("edit, message", BAD, ids=[m[:40] for _, m in BAD])
def test_a_bad_field_is_named_with_the_fix(edit: Callable[[dict[str, Any]], None], message: str) -> None:
    good = json.loads((GOLDEN / "hf_gpt2_2stages_1f1b" / "manifest.json").read_text())
    bad = copy.deepcopy(good)
    edit(bad)
    with pytest.raises(ManifestError, match=rf"^pkg/manifest.json is corrupt: {message}; compile the model again\.$"):
        Manifest.from_json(json.dumps(bad), origin="pkg/manifest.json")


def test_not_json_or_another_version() -> None:
    with pytest.raises(ManifestError, match=r"m.json is corrupt \(not JSON"):
        Manifest.from_json("{", origin="m.json")
    with pytest.raises(ManifestError, match=r"m.json is corrupt \(a JSON list, not an object\)"):
        Manifest.from_json("[]", origin="m.json")
    with pytest.raises(ManifestError, match=r"format_version 2 but this runtime reads format_version 1"):
        Manifest.from_json({"format_version": 2}, origin="m.json")


def test_a_package_folder_is_read_by_one_reader(tmp_path: Path) -> None:
    """read_manifest(DIR) reads a golden package as Manifest.from_json reads its text, and
    names a missing folder, a missing file and a file without format_version."""
    golden = GOLDEN / "mlp_3stages_1f1b"
    assert read_manifest(golden) == Manifest.from_json((golden / "manifest.json").read_text())
    with pytest.raises(ManifestError, match=r"nothing is not a package directory"):
        read_manifest(tmp_path / "nothing")
    (tmp_path / "bad").mkdir()
    with pytest.raises(ManifestError, match=r"bad has no manifest.json"):
        read_manifest(tmp_path / "bad")
    (tmp_path / "bad" / "manifest.json").write_text(json.dumps({"stages": []}))
    with pytest.raises(ManifestError, match=r"is corrupt: it has no 'format_version' field"):
        read_manifest(tmp_path / "bad")


def test_one_mesh_places_every_rank() -> None:
    """The manifest's Mesh is the runtime's (runtime.groups re-exports it): rank and coords
    are inverse over the whole world, tensor-parallel ranks neighbours."""
    assert GroupsMesh is Mesh
    mesh = Mesh(pp=3, tp=2, dp=2)
    assert mesh.world == 12 and [mesh.rank(*mesh.coords(r)) for r in range(mesh.world)] == list(range(12))
    assert mesh.rank(1, 2, 1) == (1 * 3 + 2) * 2 + 1 and mesh.coords(mesh.rank(1, 2, 1)) == (1, 2, 1)
    m = read_manifest(GOLDEN / "gpt_wide_2stages_tp2")
    assert Mesh.from_manifest(m) is m.mesh
