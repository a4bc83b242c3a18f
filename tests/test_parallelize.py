"""`partitioner.parallelize` (driver/parallelize.py): a model built in the script trains like the
unsplit model in one process and on 2 and 4 gloo ranks; a second call reuses the package; the
package is self-contained; what cannot be recorded is refused with the fix."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import partitioner
from driver import parallelize as parallelize_module
from partitioner.errors import ParallelizeError
from runtime.manifest import read_manifest

from .conftest import FREE_LINKS, ROOT
from .parallelize_models import build
from .runtime.test_distributed import _ok, launch

FAST = {"analytic": True, "hardware": "a100", "time_limit": 5.0, "quiet": True}
RTOL, ATOL = 1e-5, 1e-6


def _train_alike(pipe: Any, model: torch.nn.Module, example: Any, target: torch.Tensor, loss_fn: Any) -> None:
    """2 SGD steps of the pipeline and of the original: same losses, same weights."""
    args, kwargs = example
    opt, ref = torch.optim.SGD(pipe.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        ref.zero_grad()
        got = pipe.train_step(kwargs or args, target)
        want = loss_fn(model(*args, **kwargs), target)
        want.backward()
        opt.step()
        ref.step()
        torch.testing.assert_close(got.detach(), want.detach(), rtol=RTOL, atol=ATOL)
    state = pipe.state_dict()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=RTOL, atol=ATOL, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_one_process_trains_like_the_model(name: str, tmp_path: Path) -> None:
    model, example, target, loss_fn = build(name)
    original = copy.deepcopy(model)
    pipe = partitioner.parallelize(model, example[1] or example[0], loss_fn, out=tmp_path / "pkg", stages=2, **FAST)
    assert type(pipe).__name__ == "LocalPipeline"
    assert read_manifest(tmp_path / "pkg").mesh.pp == 2
    _train_alike(pipe, original, example, target, loss_fn)


def test_second_call_reuses_the_package(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    model, example, target, loss_fn = build("gpt")
    first = partitioner.parallelize(model, example[0], loss_fn, stages=2, **FAST)  # the cache folder
    monkeypatch.setattr(parallelize_module, "compile_model", _no_compile)
    second = partitioner.parallelize(model, example[0], loss_fn, stages=2, **FAST)
    assert second.directory == first.directory
    assert "reusing the package" in capsys.readouterr().err
    with pytest.raises(AssertionError, match="compiled again"):  # other options: another package
        partitioner.parallelize(model, example[0], loss_fn, stages=3, microbatches=3, **FAST)


def _no_compile(*_args: Any, **_kwargs: Any) -> None:
    raise AssertionError("compiled again")


def test_meta_model_starts_from_init_weights(tmp_path: Path) -> None:
    model, example, target, loss_fn = build("gpt")
    import gpt

    with torch.device("meta"):
        meta = gpt.build_model()
    pipe = partitioner.parallelize(meta, example[0], loss_fn, out=tmp_path / "pkg", stages=2, **FAST)
    pipe.init_weights(seed=3)
    import runtime

    runtime.init_weights(model, seed=3)
    _train_alike(pipe, model, example, target, loss_fn)


def test_package_is_self_contained(tmp_path: Path) -> None:
    """The package keeps gpt.py (the module of the model's class) and a model file whose
    build_model() rebuilds the model; `show` reads it."""
    model, example, _target, loss_fn = build("gpt")
    partitioner.parallelize(model, example[0], loss_fn, out=tmp_path / "pkg", stages=2, **FAST)
    manifest = json.loads((tmp_path / "pkg" / "manifest.json").read_text())
    assert manifest["source"]["modules"] == ["gpt.py"]
    from runtime.package import load_model_file

    rebuilt = load_model_file(read_manifest(tmp_path / "pkg"), tmp_path / "pkg").build_model()
    assert {k: v.shape for k, v in rebuilt.state_dict().items()} == {k: v.shape for k, v in model.state_dict().items()}
    from driver.cli import main

    assert main(["show", str(tmp_path / "pkg")]) == 0


def test_unknown_option_names_the_known_ones() -> None:
    model, example, _target, loss_fn = build("gpt")
    with pytest.raises(ParallelizeError, match=r"unknown option virtual_stage: .*virtual_stages"):
        partitioner.parallelize(model, example[0], loss_fn, virtual_stage=2)


def test_a_folder_of_other_files_is_not_replaced(tmp_path: Path) -> None:
    model, example, _target, loss_fn = build("gpt")
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ParallelizeError, match=r"not an earlier package \(notes.txt\).*give a new or empty folder.*force=True"):
        partitioner.parallelize(model, example[0], loss_fn, out=tmp_path, stages=2, **FAST)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    partitioner.parallelize(model, example[0], loss_fn, out=tmp_path, stages=2, force=True, **FAST)
    assert (tmp_path / "notes.txt").read_text() == "mine" and (tmp_path / "manifest.json").is_file()


def test_lambda_loss_fn_is_refused_with_the_fix(tmp_path: Path) -> None:
    model, example, _target, _loss = build("gpt")
    with pytest.raises(ParallelizeError, match=r"not a function defined at the top level.*def loss_fn"):
        partitioner.parallelize(model, example[0], lambda out, y: out.sum(), out=tmp_path / "p", **FAST)


CASES = {  # name: (ranks, model, options, local)
    "gpt-pp2": (2, "gpt", {"stages": 2}, False),
    "gpt-pp2-pipelining": (2, "gpt", {"stages": 2, "engine": "pipelining"}, False),
    "llama-pp2": (2, "llama", {"stages": 2}, False),
    "gpt-pp2-dp2-local": (4, "gpt", {"stages": 2, "dp": 2}, True),
    "llama-pp2-dp2": (4, "llama", {"stages": 2, "dp": 2}, False),
    "gpt-tp2": (2, "gpt", {"stages": 1, "tp": 2, "hardware": FREE_LINKS}, False),
}


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(CASES))
def test_ranks_train_like_the_model(case: str, tmp_path: Path) -> None:
    n, model, options, local = CASES[case]
    spec = json.dumps({"model": model, "options": FAST | options, "local": local})
    ranks = launch(n, "parallelize", [tmp_path / "pkg"], tmp_path / "unused.py", deadline_s=240,
                   env={"PARALLELIZE_CASE": spec})
    _ok(ranks)
    mesh = read_manifest(tmp_path / "pkg").mesh
    assert (mesh.dp, mesh.tp) == (options.get("dp", 1), options.get("tp", 1))


SCRIPT = Path(__file__).with_name("scripts") / "custom_function_script.py"
#: the package trained in a fresh process from another folder, after the script is gone
MOVED = """
import sys, torch, runtime
pipe = runtime.LocalPipeline(sys.argv[1])
pipe.init_weights(seed=1)
x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
print("loss", float(pipe.train_step((x,), y)))
"""


def _python(cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=full, capture_output=True, text=True, timeout=300)


@pytest.mark.timeout(300)
def test_script_with_a_custom_function_and_its_package_elsewhere(tmp_path: Path) -> None:
    """The model class, its autograd Function and loss_fn in the script: the package keeps the
    script's copy, trains like the model, and runs from another folder after the script is gone."""
    shutil.copy(SCRIPT, tmp_path / "my_train.py")
    done = _python(tmp_path, "my_train.py")
    assert "script ok" in done.stdout, done.stderr[-3000:]
    assert "my_train.Square.apply" in "".join(p.read_text() for p in (tmp_path / "pkg").glob("stage_*.py"))
    (tmp_path / "my_train.py").unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    moved = _python(elsewhere, "-c", MOVED, str(tmp_path / "pkg"))
    assert moved.returncode == 0 and "loss" in moved.stdout, moved.stderr[-3000:]


@pytest.mark.timeout(300)
def test_unguarded_script_is_refused_with_the_fix(tmp_path: Path) -> None:
    """A script whose work runs at import (no `if __name__ == "__main__":`) cannot be copied."""
    unguarded = SCRIPT.read_text().replace('if __name__ == "__main__":\n    main()', "main()")
    (tmp_path / "my_train.py").write_text(unguarded)
    done = _python(tmp_path, "my_train.py")
    assert done.returncode != 0
    assert "ParallelizeError" in done.stderr and 'if __name__ == "__main__":' in done.stderr, done.stderr[-3000:]


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_failed_compile_stops_every_rank_with_its_message(tmp_path: Path) -> None:
    """Rank 0 raises its PlanError (24 rows do not split into 5 microbatches); rank 1 raises it too."""
    plan = "does not split into 5 microbatches"
    spec = json.dumps({"model": "gpt", "options": FAST | {"stages": 2, "microbatches": 5}, "local": False,
                       "error": [["PlanError", plan], ["ParallelizeError", "rank 0 could not make the package", plan]]})
    _ok(launch(2, "parallelize", [tmp_path / "pkg"], tmp_path / "unused.py", deadline_s=120,
               env={"PARALLELIZE_CASE": spec}))
