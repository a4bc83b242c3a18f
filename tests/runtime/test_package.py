"""Reading a package: manifest errors, the model file, shards, microbatches, imports."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from typing import Any

import runtime
from runtime import package
from runtime.errors import BatchError, ManifestError
from runtime.manifest import Manifest, Mesh, ModelInput, ParamSpec, Shard, Source, StageSpec

from .conftest import Tiny

RUNTIME = Path(runtime.__file__).parent


def test_runtime_never_imports_the_compiler() -> None:
    """A rank needs torch alone: no partitioner, codegen or OR-Tools anywhere in runtime/."""
    banned = {"partitioner", "codegen", "ortools", "networkx"}
    for file in sorted(RUNTIME.rglob("*.py")):
        tree = ast.parse(file.read_text(), str(file))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                    "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
                names = [str(node.args[0].value)]
            for name in names:
                assert name.split(".")[0] not in banned, f"{file.relative_to(RUNTIME)}:{node.lineno} imports {name}"
    assert (RUNTIME / "schedule" / "registry.py") in set(RUNTIME.rglob("*.py"))  # subpackages are read too


def test_every_public_name_of_the_runtime_resolves() -> None:
    """[Note: lazy runtime]: each name of `__all__` is read from its module on first use."""
    for name in runtime.__all__:
        assert getattr(runtime, name) is not None, name
    assert runtime.LocalPipeline.__module__ == "runtime.local"
    assert runtime.SCHEDULES == ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v")
    assert set(runtime.__all__) <= set(dir(runtime))
    assert runtime.tp.__name__ == "runtime.tp"  # a submodule, as an attribute
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        runtime.nothing  # noqa: B018


def test_manifest_errors(tmp_path: Path, tiny: Tiny) -> None:
    with pytest.raises(ManifestError, match=r"package directory '.*nowhere' does not exist"):
        runtime.LocalPipeline(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ManifestError, match=r"manifest.json is missing, so .*empty is not a compiled package"):
        runtime.LocalPipeline(tmp_path / "empty")
    manifest = tiny.dir / "manifest.json"
    good = manifest.read_text()
    manifest.write_text(good[:40])
    with pytest.raises(ManifestError, match=r"manifest.json is corrupt \(not JSON"):
        runtime.LocalPipeline(tiny.dir)
    manifest.write_text(json.dumps({**json.loads(good), "format_version": 7}))
    with pytest.raises(ManifestError, match=r"format_version 7 but this runtime reads format_version 1"):
        runtime.LocalPipeline(tiny.dir)
    broken = json.loads(good)
    del broken["stages"][1]["outputs"]
    manifest.write_text(json.dumps(broken))
    with pytest.raises(ManifestError, match=r"stage 1 has no 'outputs' field; compile the model again"):
        runtime.LocalPipeline(tiny.dir)
    manifest.write_text(good)
    (tiny.dir / "stage_2.py").unlink()
    with pytest.raises(ManifestError, match=r"stage 2's file .*stage_2.py is missing"):
        runtime.LocalPipeline(tiny.dir)


def test_model_file_lookup(tiny: Tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manifest = package.load_manifest(tiny.dir)
    # relative to the package's parent (the cwd is the repo root, which has no tiny.py)
    assert callable(package.load_loss_fn(manifest, tiny.dir))
    monkeypatch.chdir(tiny.dir.parent)  # relative to the current directory
    assert callable(package.load_loss_fn(manifest, "pkg"))
    absolute = dataclasses.replace(manifest, source=dataclasses.replace(manifest.source, path=str(tiny.dir.parent / "tiny.py")))
    assert callable(package.load_loss_fn(absolute, tmp_path))
    gone = dataclasses.replace(manifest, source=dataclasses.replace(manifest.source, path="gone.py"))
    with pytest.raises(ManifestError, match=r"model file 'gone.py' is not found .* pass loss_fn= to train_step"):
        package.load_loss_fn(gone, tiny.dir)
    (tiny.dir.parent / "tiny.py").write_text("x = 1\n")
    with pytest.raises(ManifestError, match=r"defines no loss_fn\(output, target\)"):
        package.load_loss_fn(manifest, tiny.dir)


def test_each_stage_imports_its_own_file_under_a_unique_name(tiny: Tiny) -> None:
    manifest = package.load_manifest(tiny.dir)
    a, b = package.import_stage(tiny.dir, manifest, 1), package.import_stage(tiny.dir, manifest, 1)
    assert type(a).__module__ != type(b).__module__ and type(a).__name__ == "Stage1"


def test_split_target_tuple() -> None:
    target = (torch.arange(8.0), torch.arange(16.0).reshape(8, 2))
    pieces = package.split_target(target, 2, replica=1, replicas=2)
    assert [p[0].tolist() for p in pieces] == [[4.0, 5.0], [6.0, 7.0]]
    assert pieces[1][1].tolist() == [[12.0, 13.0], [14.0, 15.0]]
    # [Note: microbatch weights]: uneven microbatches as torch.tensor_split cuts them
    assert [p.shape[0] for p in package.split_target(torch.zeros(8), 3)] == [3, 3, 2]
    with pytest.raises(BatchError, match="do not split evenly across 2 data-parallel replicas"):
        package.split_target(torch.zeros(7), 2, replicas=2)
    with pytest.raises(BatchError, match="2 per replica cannot fill 3 microbatches: give at least 3 rows"):
        package.split_target(torch.zeros(2), 3)


def test_split_inputs_along_batch_dim() -> None:
    manifest = _manifest(microbatches=2, inputs=(ModelInput("x", "x", 1, (3, 2), "float32"),
                                                 ModelInput("flag", "flag", 0, None, None)))
    x = torch.arange(12.0).reshape(3, 4)
    mbs = package.split_inputs({"x": x, "flag": True}, manifest)
    assert torch.equal(mbs[1]["x"], x[:, 2:]) and mbs[0]["flag"] is True


def test_sharded_parameters_load_and_reassemble() -> None:
    specs = [ParamSpec("w", "w", (2, 3), shard=Shard(0, i, 2)) for i in range(2)]
    stages = tuple(StageSpec(k, f"stage_{k}", f"Stage{k}", (k,), (), (), (s,)) for k, s in enumerate(specs))
    manifest = _manifest(stages=stages, state_dict_aliases={"lm.weight": "w"})
    full = torch.arange(12.0).reshape(4, 3)
    shards = [torch.zeros(2, 3), torch.zeros(2, 3)]
    for spec, t in zip(specs, shards):
        package.load_stage_state([(spec, t)], {"w": full, "lm.weight": full}, manifest)
    assert torch.equal(shards[1], full[2:])
    out = package.assemble_state_dict(list(zip(specs, shards)), manifest)
    assert torch.equal(out["w"], full) and out["lm.weight"] is out["w"]


def test_stage_output_count_is_checked(tiny: Tiny) -> None:
    source = tiny.dir / "stage_0.py"
    source.write_text(source.read_text().replace("return (tanh, relu,)", "return (tanh,)"))
    pipe = runtime.LocalPipeline(tiny.dir)
    with pytest.raises(runtime.PipelineError, match=r"stage 0 \(Stage0\).forward returned a tuple of 1 but the manifest lists 2"):
        pipe(tiny.batch()[0])
    assert os.path.exists(source)


def _manifest(**fields: Any) -> Manifest:
    """A manifest with only the fields a test gives (the rest never read)."""
    base = {"source": Source("model.py"), "mesh": Mesh(1), "schedule": "gpipe", "microbatches": 1, "inputs": (),
            "stages": ()}
    return Manifest(**{**base, **fields})
