"""A package is self-contained ([Note: the model file's copy] in runtime/manifest.py): it
trains from any working directory after its model file has moved (loss_fn, init_weights,
batches and a module kept whole read from its copy), and compiling the same model file
from two folders writes the same bytes."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from runtime import package
from runtime.errors import ManifestError
from runtime.manifest import MODEL_COPY, Manifest, Source, read_manifest

from .conftest import ROOT, compile_example

MODEL = ROOT / "tests" / "model_files" / "self_contained.py"
COMPILE = ["--stages", "2", "--analytic", "--hardware", "a100", "--time-limit", "5", "--quiet"]

#: run in another folder: the package trained on its copy's batches() with its copy's loss_fn
#: and init_weights, against the original model (loaded from where it moved) trained alike
TRAIN = """
import importlib.util, sys
import torch
import runtime
from runtime import package

pkg, moved = sys.argv[1], sys.argv[2]
spec = importlib.util.spec_from_file_location("moved_model", moved)
original = importlib.util.module_from_spec(spec)
spec.loader.exec_module(original)
model = runtime.init_weights(original.build_model(), seed=3, model_init=original.init_weights)
pipe = runtime.LocalPipeline(pkg)
pipe.init_weights(seed=3)
mf = package.load_model_file(pipe.manifest, pkg)
opt, ref = torch.optim.SGD(pipe.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
for inputs, target in mf.batches():
    opt.zero_grad(); ref.zero_grad()
    got = pipe.train_step(inputs, target)
    want = original.loss_fn(model(*inputs), target)
    want.backward()
    opt.step(); ref.step()
    torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6)
state = pipe.state_dict()
for key, value in model.state_dict().items():
    torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: key + ": " + m)
print("trained", len(list(mf.batches())), "steps alike")
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _compile(model: str, out: str, cwd: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "partitioner", "compile", model, "--out", out, *COMPILE],
                          cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_a_package_trains_from_another_folder_after_its_model_file_moved(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    shutil.copy(MODEL, tmp_path / "src" / "net.py")
    _compile("net.py", "../pkg", tmp_path / "src")  # paths relative to the compile's folder
    moved = tmp_path / "elsewhere" / "renamed.py"
    moved.parent.mkdir()
    shutil.move(tmp_path / "src" / "net.py", moved)
    shutil.rmtree(tmp_path / "src")
    (tmp_path / "run").mkdir()
    done = subprocess.run([sys.executable, "-c", TRAIN, "../pkg", str(moved)], cwd=tmp_path / "run", env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "trained 3 steps alike" in done.stdout
    assert "kept_module(__file__, 'gate')" in "".join(p.read_text() for p in (tmp_path / "pkg").glob("stage_*.py"))


@pytest.mark.slow
def test_two_folders_compile_the_same_bytes(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "checkout" / "two"
    for folder in (one, two):
        folder.mkdir(parents=True)
        shutil.copy(MODEL, folder / "net.py")
    _compile("net.py", "pkg", one)  # a relative model path, run in its folder
    _compile(str(two / "net.py"), str(tmp_path / "pkg_two"), tmp_path)  # absolute paths, run elsewhere
    first, second = one / "pkg", tmp_path / "pkg_two"
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir()) and MODEL_COPY in names
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), f"{name} differs"
        assert str(tmp_path) not in (first / name).read_text(), f"{name} names a folder of this machine"
    assert (first / MODEL_COPY).read_bytes() == MODEL.read_bytes()
    assert read_manifest(first).source.path == "net.py"


def _manifest(source: Source) -> Manifest:
    """A package's manifest with its `source` replaced."""
    text = json.loads((ROOT / "tests" / "golden" / "mlp_3stages_1f1b" / "manifest.json").read_text())
    text["source"] = source.to_dict()
    return Manifest.from_json(text)


def test_an_edited_copy_is_refused(tmp_path: Path) -> None:
    (tmp_path / MODEL_COPY).write_text(MODEL.read_text() + "\n# edited\n")
    with pytest.raises(ManifestError, match=r"the copy was edited; compile the model again"):
        package.load_model_file(_manifest(Source("net.py", _sha(MODEL), copy=MODEL_COPY)), tmp_path)


def test_a_lost_copy_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match=r"has lost its copy of the model file \(model_file.py, from net.py\)"):
        package.load_model_file(_manifest(Source("net.py", _sha(MODEL), copy=MODEL_COPY)), tmp_path)


def test_a_package_compiled_before_copies_still_loads(tmp_path: Path) -> None:
    """An older manifest names the model file by the path given to the compile."""
    old = _manifest(Source("tests/model_files/self_contained.py", _sha(MODEL)))
    assert "copy" not in old.source.to_dict()
    assert callable(package.load_model_file(old, tmp_path / "pkg").loss_fn)


def test_a_module_beside_the_model_file_is_found_on_sys_path_or_named(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "sc_sibling_helpers.py").write_text("SCALE = 2.0\n")
    text = "import sc_sibling_helpers\n" + MODEL.read_text()
    (tmp_path / MODEL_COPY).write_text(text)
    manifest = _manifest(Source("net.py", _sha(tmp_path / MODEL_COPY), copy=MODEL_COPY))
    monkeypatch.delitem(sys.modules, "sc_sibling_helpers", raising=False)
    with pytest.raises(ManifestError, match=r"imports 'sc_sibling_helpers', which is not found: .* Put the folder "
                                            r"that holds sc_sibling_helpers on PYTHONPATH"):
        package.load_model_file(manifest, tmp_path)
    monkeypatch.syspath_prepend(str(folder))
    assert package.load_model_file(manifest, tmp_path).sc_sibling_helpers.SCALE == 2.0


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_module_beside_the_model_file_is_copied_with_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`import sc_parts` beside net.py: sc_parts.py is copied too (its own `import
    sc_deeper` as well), so the package loads after their folder is gone."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "sc_parts.py").write_text("import sc_deeper\n\nWIDTH = sc_deeper.WIDTH\n")
    (src / "sc_deeper.py").write_text("WIDTH = 16\n")
    (src / "stage_0.py").write_text("CLASH = True\n")  # named like a stage file: not copied
    (src / "net.py").write_text("import sc_parts\nimport stage_0\n" + MODEL.read_text())
    compile_example(str(src / "net.py"), tmp_path / "pkg", stages=2)
    shutil.rmtree(src)
    for name in ("sc_parts", "sc_deeper", "stage_0"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    manifest = package.load_manifest(tmp_path / "pkg")
    assert manifest.source.modules == ("sc_deeper.py", "sc_parts.py")
    assert package.load_model_file(manifest, tmp_path / "pkg").sc_parts.WIDTH == 16
    assert "CLASH" not in (tmp_path / "pkg" / "stage_0.py").read_text()
