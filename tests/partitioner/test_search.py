"""`--devices N` searches stages x tp x dp = N and the microbatch count."""

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
    assert {(pp, tp, dp) for pp, tp, dp, _ in meshes} == {
        (4, 1, 1), (2, 1, 2), (1, 1, 4), (2, 2, 1), (1, 2, 2), (1, 4, 1)}
    assert all(24 % (m * dp) == 0 for _, _, dp, m in meshes)
    assert (4, 1, 1, 16) not in meshes  # 16 microbatches do not split 24 rows


def test_a_given_tp_or_stage_count_narrows_the_search() -> None:
    meshes = _meshes(8, 24, CompileOptions(model="m.py", out="o", devices=8, tp=2))
    assert {tp for _, tp, _, _ in meshes} == {2}
    meshes = _meshes(8, 24, CompileOptions(model="m.py", out="o", devices=8, stages=2))
    assert {(pp, tp, dp) for pp, tp, dp, _ in meshes} == {(2, 1, 4), (2, 2, 2), (2, 4, 1)}


def test_search_over_tp_keeps_the_fastest_predicted_mesh(tmp_path: Path) -> None:
    compiled = compile_example("tests/model_files/gpt_wide.py", tmp_path / "pkg", devices=4, stages=None)
    manifest = compiled.manifest
    candidates = manifest["predicted"]["candidates"]
    assert any(c["tp"] > 1 for c in candidates), "a wide model on an A100 profile splits"
    best = candidates[0]
    assert (manifest["mesh"]["pp"], manifest["mesh"]["tp"], manifest["mesh"]["dp"]) == (best["pp"], best["tp"], best["dp"])
    assert [c["step_time_s"] for c in candidates] == sorted(c["step_time_s"] for c in candidates)
    assert all(c["pp"] * c["dp"] * c["tp"] == 4 for c in candidates)


def test_search_picks_the_fastest_mesh_and_trains_like_the_original(tmp_path: Path) -> None:
    compiled = compile_example("examples/mlp.py", tmp_path / "pkg", devices=4, stages=None, tp=1)
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
