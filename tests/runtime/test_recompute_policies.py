"""`--recompute selective | auto` at run time: training gives the weights the original
model gives (float32, rtol 1e-5) in one process and on 2 gloo ranks, selective runs the
matmuls once and the rest twice, dropout draws the same masks, old packages load."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import runtime
from partitioner.trace import model_file

from ..conftest import compile_example, train_original, train_pipeline
from ..zoo.harness import trains_like_original
from .test_distributed import _ok, launch, multiproc
from .test_recompute import _DROPOUT

STEPS, LR = 2, 0.05
GPT = "examples/gpt.py"
GPT48 = "examples/gpt48.py"
#: 2 stages of 1F1B, 8 microbatches: rank 0 holds two in flight, rank 1 one
DEEP = dict(stages=2, microbatches=8, schedule="1f1b", offload="none")  # recomputation alone binds


def _trains_like_original(example: str, out: Path, **options: Any) -> runtime.LocalPipeline:
    compile_example(example, out, **options)
    return _matches_original(example, out)


def _matches_original(example: str, out: Path) -> runtime.LocalPipeline:
    """The package `out` trained STEPS SGD steps in one process: the losses and weights of
    the original model's."""
    want_losses, want = train_original(example, STEPS, LR)
    pipe = runtime.LocalPipeline(str(out))
    pipe.load_state_dict(model_file.load(example).build(0).state_dict())
    got_losses = train_pipeline(pipe, example, STEPS, LR)
    torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(want_losses), rtol=1e-5, atol=1e-6)
    got = pipe.state_dict()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    return pipe


@pytest.mark.parametrize("options", [
    {"stages": 2, "schedule": "1f1b", "recompute": "selective"},
    {"stages": 3, "schedule": "gpipe", "recompute": "selective"},
    {"stages": 2, "schedule": "interleaved", "microbatches": 4, "recompute": "selective"},
    {"stages": 2, "schedule": "zb-h1", "recompute": "selective"},
])
def test_selective_training_matches_the_original(options: dict[str, Any], tmp_path: Path) -> None:
    pipe = _trains_like_original(GPT, tmp_path / "pkg", **options)
    assert all(r.recompute == "selective" for r in pipe.runners)


def test_auto_training_matches_the_original(tmp_path: Path) -> None:
    """A limit that only rank 0 misses without recomputation: rank 0 recomputes, rank 1 not."""
    mesh = dict(stages=2, microbatches=8, schedule="1f1b", offload="none")  # recomputation alone binds
    none = compile_example(GPT, tmp_path / "none", **mesh)
    walked = [s.memory_bytes for s in none.manifest.predicted.stages]  # each rank's peak over its schedule
    limit = max(walked[1], walked[0] * 95 // 100)
    pipe = _trains_like_original(GPT, tmp_path / "pkg", recompute="auto", memory=limit, **mesh)
    assert pipe.runners[0].recompute is not None and pipe.runners[1].recompute is None


def _split_with_policies(tmp_path: Path) -> None:
    """gpt48 under 97% of what keeping every activation needs, 2 stages of 1F1B with 12
    microbatches (rank 0 holds two in flight, rank 1 one): auto chooses the split and each
    stage's policy together, rank 0 selective with fewer blocks than selective on every
    stage gives it, rank 1 nothing recomputed, within the limit by the walked peak."""
    mesh = dict(DEEP, microbatches=12)
    none = compile_example(GPT48, tmp_path / "none", **mesh)
    limit = max(s.memory_bytes for s in none.manifest.predicted.stages) * 97 // 100  # by the walked peaks
    uniform = compile_example(GPT48, tmp_path / "selective", recompute="selective", memory=limit, **mesh)
    auto = compile_example(GPT48, tmp_path / "pkg", recompute="auto", memory=limit, **mesh)
    assert [s.recompute for s in auto.manifest.stages] == ["selective", None]
    assert len(auto.plan.stages[0].nodes) < len(uniform.plan.stages[0].nodes)  # not the uniform policy's split
    assert auto.manifest.predicted.step_time_s < uniform.manifest.predicted.step_time_s
    assert max(s.memory_bytes for s in auto.manifest.predicted.stages) <= limit
    shutil.copy(GPT, tmp_path / "pkg")  # the package's copy of gpt48.py loads gpt.py from its own folder


def test_auto_with_its_own_split_trains_like_the_original(tmp_path: Path) -> None:
    _split_with_policies(tmp_path)
    pipe = _matches_original(GPT48, tmp_path / "pkg")
    assert [r.recompute for r in pipe.runners] == ["selective", None]


def test_a_zoo_llama_trains_like_the_original_selective(tmp_path: Path) -> None:
    pipe = trains_like_original("hf_llama", tmp_path / "pkg", tracer="export", stages=2, recompute="selective")
    assert all(r.recompute == "selective" for r in pipe.runners)


def test_a_zoo_llama_trains_like_the_original_auto(tmp_path: Path) -> None:
    """One stage of GPipe, a byte short of what keeping every activation needs."""
    mesh = dict(tracer="export", stages=1, microbatches=4, schedule="gpipe", offload="none")
    none = trains_like_original("hf_llama", tmp_path / "none", **mesh)
    need = none.manifest.predicted.stages[0].memory_bytes
    pipe = trains_like_original("hf_llama", tmp_path / "pkg", recompute="auto", memory=need - 1, **mesh)
    assert pipe.runners[0].recompute in ("selective", "full")


class _Ops(TorchDispatchMode):
    """Counts the aten ops run, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.seen[func._opname] += 1
        return func(*args, **(kwargs or {}))


def test_selective_runs_the_matmuls_once_and_the_rest_again(tmp_path: Path) -> None:
    counts = {}
    for policy in ("none", "selective", "full"):
        compile_example(GPT, tmp_path / policy, stages=2, microbatches=4, recompute=policy)
        pipe = runtime.LocalPipeline(str(tmp_path / policy))
        mf = model_file.load(GPT)
        args, _ = mf.example_inputs()
        with _Ops() as ops:
            pipe.train_step(args, mf.example_target())
        counts[policy] = ops.seen
    matmuls = {r: c["addmm"] + c["mm"] + c["bmm"] for r, c in counts.items()}
    assert matmuls["none"] == matmuls["selective"] < matmuls["full"]
    for op in ("gelu", "native_layer_norm"):
        assert counts["none"][op] < counts["selective"][op] == counts["full"][op], op


def test_dropout_masks_are_the_same_when_recomputed_selectively(tmp_path: Path) -> None:
    path = tmp_path / "dropout_net.py"
    path.write_text(_DROPOUT)
    mf = model_file.load(str(path))
    grads = {}
    for recompute in ("none", "selective"):
        compile_example(str(path), tmp_path / recompute, stages=2, microbatches=4, recompute=recompute)
        pipe = runtime.LocalPipeline(str(tmp_path / recompute))
        pipe.load_state_dict(mf.build(0).state_dict())
        args, _ = mf.example_inputs()
        pipe.train_step(args, mf.example_target())
        grads[recompute] = {name: p.grad.clone() for name, p in pipe.named_parameters()}
    for name, g in grads["none"].items():
        torch.testing.assert_close(grads["selective"][name], g, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_an_old_package_with_recompute_true_loads_as_full(tmp_path: Path) -> None:
    compile_example(GPT, tmp_path / "pkg", stages=2, recompute="full")
    manifest = tmp_path / "pkg" / "manifest.json"
    data = json.loads(manifest.read_text())
    assert [s["recompute"] for s in data["stages"]] == ["full", "full"]
    for stage in data["stages"]:
        stage["recompute"] = True  # as packages were written before policies
    manifest.write_text(json.dumps(data, indent=1))
    pipe = runtime.LocalPipeline(str(tmp_path / "pkg"))
    assert [r.recompute for r in pipe.runners] == ["full", "full"]


def test_a_bad_policy_in_a_manifest_names_the_field(tmp_path: Path) -> None:
    compile_example(GPT, tmp_path / "pkg", stages=2)
    manifest = tmp_path / "pkg" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["stages"][0]["recompute"] = "some"
    manifest.write_text(json.dumps(data, indent=1))
    with pytest.raises(Exception, match=r"stages\[0\]\.recompute: expected one of none, selective, full"):
        runtime.LocalPipeline(str(tmp_path / "pkg"))


@multiproc
@pytest.mark.timeout(120)
def test_selective_on_two_gloo_ranks_trains_like_the_original(tmp_path: Path) -> None:
    compile_example(GPT, tmp_path / "pkg", stages=2, microbatches=4, recompute="selective")
    _ok(launch(2, "check", [tmp_path / "pkg"], _copy(GPT, tmp_path)))


@multiproc
@pytest.mark.timeout(120)
def test_auto_on_two_gloo_ranks_trains_like_the_original(tmp_path: Path) -> None:
    mesh = dict(stages=2, microbatches=8, schedule="1f1b", offload="none")  # recomputation alone binds
    none = compile_example(GPT, tmp_path / "none", **mesh)
    walked = [s.memory_bytes for s in none.manifest.predicted.stages]  # each rank's peak over its schedule
    limit = max(walked[1], walked[0] * 95 // 100)
    auto = compile_example(GPT, tmp_path / "pkg", recompute="auto", memory=limit, **mesh)
    assert auto.manifest.stages[0].recompute is not None and auto.manifest.stages[1].recompute is None
    _ok(launch(2, "check", [tmp_path / "pkg"], _copy(GPT, tmp_path)))


@pytest.mark.slow
@multiproc
@pytest.mark.timeout(180)
def test_auto_with_its_own_split_on_two_gloo_ranks_trains_like_the_original(tmp_path: Path) -> None:
    _split_with_policies(tmp_path)
    _copy(GPT, tmp_path)  # gpt48.py loads gpt.py from its own folder
    _ok(launch(2, "check", [tmp_path / "pkg"], _copy(GPT48, tmp_path), deadline_s=120.0))


def _copy(model: str, folder: Path) -> Path:
    """The model file copied into `folder`, beside which the ranks write their output."""
    return Path(shutil.copy(model, folder / Path(model).name))
