"""`--devices N` searches stages x dp = N and the microbatch count."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import runtime
from partitioner import model_file
from partitioner.search import _meshes
from partitioner.compiler import CompileOptions

from ..conftest import compile_example


def test_meshes_cover_every_factorisation_that_splits_the_batch() -> None:
    opts = CompileOptions(model="m.py", out="o", devices=4)
    meshes = _meshes(4, 24, opts)
    assert {(pp, dp) for pp, dp, _ in meshes} == {(4, 1), (2, 2), (1, 4)}
    assert all(24 % (m * dp) == 0 for _, dp, m in meshes)
    assert (4, 1, 16) not in meshes  # 16 microbatches do not split 24 rows


def test_search_picks_the_fastest_mesh_and_trains_like_the_original(tmp_path: Path) -> None:
    compiled = compile_example("examples/mlp.py", tmp_path / "pkg", devices=4, stages=None)
    manifest = compiled.manifest
    candidates = manifest["predicted"]["candidates"]
    assert candidates, "the searched meshes are recorded"
    times = [c["step_time_s"] for c in candidates]
    assert times == sorted(times)
    best = candidates[0]
    assert (manifest["mesh"]["pp"], manifest["mesh"]["dp"], manifest["microbatches"]) == (
        best["pp"], best["dp"], best["microbatches"])
    assert all(c["pp"] * c["dp"] * c["tp"] == 4 for c in candidates)
    assert manifest["predicted"]["step_time_s"] == pytest.approx(best["step_time_s"])
    mf = model_file.load("examples/mlp.py")
    model = mf.build(0)
    pipe = runtime.LocalPipeline(str(tmp_path / "pkg"))
    pipe.load_state_dict(model.state_dict())
    args, _ = mf.example_inputs()
    target = mf.example_target()
    loss = pipe.train_step(args, target)
    want = mf.loss_fn()(model(*args), target)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)
    grads = dict(pipe.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-5, atol=1e-6)
