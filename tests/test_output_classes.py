"""A model's own output class ([Note: output classes] in partitioner/trace/outputs.py): a
NamedTuple, a dataclass (holding another) and a Hugging Face `ModelOutput` subclass defined in
the model file, and one defined in the user's script under `partitioner.parallelize`, train
like the original under both tracers, in one process and on two gloo ranks (both engines);
`pipe(inputs)` and what `loss_fn` receives are instances of that class, the microbatches'
fields joined.  A forward that takes `**kwargs` (Hugging Face Bloom's) trains too."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree

import runtime
from partitioner.trace import model_file
from runtime import outputs, package

from .conftest import ROOT, compile_example, train_original, train_pipeline
from .runtime.test_distributed import _ok, launch
from .zoo.harness import trains_like_original

MODEL_FILES = ROOT / "tests" / "model_files"
KINDS = ["output_namedtuple", "output_dataclass", "output_model_output"]
RTOL, ATOL = 1e-5, 1e-6


def _trains_like_the_original(path: str, out: Path, **options: object) -> runtime.LocalPipeline:
    """Compiled in 2 stages of 4 microbatches and trained 2 SGD steps: every loss and every
    weight as the original's; then `pipe(inputs)` as the original's output, field by field."""
    want_losses, want = train_original(path, 2, 0.05)
    compile_example(path, out, stages=2, microbatches=4, **options)
    pipe = runtime.LocalPipeline(str(out))
    pipe.load_state_dict(model_file.load(path).build(0).state_dict())
    got_losses = train_pipeline(pipe, path, 2, 0.05)  # loss_fn checks the class it is given
    torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(want_losses), rtol=RTOL, atol=ATOL)
    got = pipe.state_dict()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=RTOL, atol=ATOL, msg=lambda m: f"{key}: {m}")
    return pipe


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("kind", KINDS)
def test_an_output_class_of_the_model_file_trains_and_is_returned(kind: str, tracer: str, tmp_path: Path) -> None:
    path = str(MODEL_FILES / f"{kind}.py")
    pipe = _trains_like_the_original(path, tmp_path / "pkg", tracer=tracer)
    mf = model_file.load(path)
    model = mf.build(0)
    model.load_state_dict(pipe.state_dict())
    (x,), _ = mf.example_inputs()
    with torch.no_grad():
        out, want = pipe((x,)), model(x)
    assert type(out) is package.load_model_file(pipe.manifest, pipe.directory).Out  # the class loss_fn knows
    outputs.register_classes(want)  # the original's dataclasses, flattened as the pipeline's are
    torch.testing.assert_close(pytree.tree_leaves(out), pytree.tree_leaves(want), rtol=RTOL, atol=ATOL)


@pytest.mark.multiproc
@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind,engine", [(kind, "partitioner") for kind in KINDS] + [("output_dataclass", "pipelining")])
def test_an_output_class_on_two_gloo_ranks(kind: str, engine: str, tmp_path: Path) -> None:
    """Every rank's `pipe(inputs)` is the model file's class (the last stage's rank sends
    it to the others, which read the class from their own import of the model file)."""
    model = tmp_path / f"{kind}.py"
    shutil.copy(MODEL_FILES / f"{kind}.py", model)
    compile_example(str(model), tmp_path / "pkg", stages=2, microbatches=4)
    _ok(launch(2, "check", [tmp_path / "pkg"], model, deadline_s=180, env={"PIPELINE_TEST_ENGINE": engine}))


@pytest.mark.timeout(300)
def test_an_output_class_of_the_users_script_under_parallelize(tmp_path: Path) -> None:
    shutil.copy(ROOT / "tests" / "scripts" / "output_class_script.py", tmp_path / "my_train.py")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "my_train.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=280)
    assert "script ok" in done.stdout, done.stderr[-3000:]


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_forward_taking_var_keywords_trains_like_the_original(tracer: str, tmp_path: Path) -> None:
    pipe = _trains_like_the_original(str(MODEL_FILES / "var_keywords.py"), tmp_path / "pkg", tracer=tracer)
    assert [i.key for i in pipe.manifest.inputs][:2] == ["x", "mask"]  # an input of each batch, not a constant


@pytest.mark.timeout(300)
def test_hugging_face_bloom_trains_like_the_original(tmp_path: Path) -> None:
    """Bloom's forward takes `**kwargs`; export refuses its custom GELU Function, fx traces it."""
    trains_like_original("hf_bloom", tmp_path / "pkg", stages=2, tracer="fx")
