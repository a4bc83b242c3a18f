"""engine="pipelining" (runtime/engines/): the package's stages run by torch.distributed.pipelining
train like the original model and like engine="partitioner", and a checkpoint of either engine
resumes on the other (engine_worker.py, MODE engines, on gloo ranks)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import runtime
from runtime.engines import check_engine
from runtime.engines.torch_stages import check_chain, schedule_class
from runtime.errors import EngineError
from runtime import package

from ..conftest import compile_example
from .conftest import Tiny
from .test_distributed import _ok, launch, multiproc
from .test_distributed_training import _with_zero
from .test_local_rows import _free_batch
from .tp_package import write_tp_package

ROOT = Path(__file__).resolve().parents[2]
MODELS = {"gpt": ROOT / "examples" / "gpt.py", "tied-gpt": ROOT / "tests" / "model_files" / "gpt_bare_positions.py"}
#: every schedule torch has a class for, on 2 ranks (interleaved and zb-v: 2 stages per rank)
TWO_RANKS: dict[str, dict[str, Any]] = {
    "gpipe": dict(stages=2, schedule="gpipe"),
    "1f1b": dict(stages=2, schedule="1f1b"),
    "interleaved": dict(stages=2, virtual_stages=2, schedule="interleaved"),
    "zb-h1": dict(stages=2, schedule="zb-h1"),
    "zb-v": dict(stages=2, schedule="zb-v"),
}


#: the other examples, each under 1F1B on 2 ranks
OTHER_EXAMPLES = {name: ROOT / "examples" / f"{name}.py" for name in ("mlp", "bert", "ncf", "skip", "hf_gpt2", "hf_llama")}


def _runs(tmp_path: Path, plans: dict[str, dict[str, Any]], models: dict[str, Path] = MODELS) -> tuple[Path, str]:
    """Every model compiled with every plan; (a model file, ENGINE_RUNS) for one job, the
    model files copied into `tmp_path` (the ranks' output folders go beside the first)."""
    runs = []
    for model, path in models.items():
        copy = tmp_path / path.name
        shutil.copy(path, copy)
        for name, options in plans.items():
            out = tmp_path / f"{model}-{name}"
            compile_example(str(copy), out, **options)
            runs.append(f"{out}|{copy}")
    return tmp_path / next(iter(models.values())).name, ";".join(runs)


def _launch(tmp_path: Path, n: int, plans: dict[str, dict[str, Any]], deadline_s: float,
            models: dict[str, Path] = MODELS) -> None:
    model, runs = _runs(tmp_path, plans, models)
    first = Path(runs.split(";")[0].split("|")[0])
    ranks = launch(n, "engines", [first], model, deadline_s=deadline_s, env={"ENGINE_RUNS": runs})
    _ok(ranks)
    for rank in ranks:
        assert rank.out.count(" ok") == len(runs.split(";")) + 1, rank.out


@multiproc
@pytest.mark.timeout(120)
def test_the_torch_engine_trains_like_the_model_and_our_engine(make_tiny: Callable[..., Tiny]) -> None:
    """The tiny package on 2 ranks (1f1b): its tied weight is on both ranks and stage 1 reads
    a model input.  2 SGD steps with momentum on both engines equal the model's, each engine
    resumes the other's checkpoint, evaluate and pipe(inputs) equal the model's."""
    t = make_tiny(stages=2, schedule="1f1b", microbatches=4)
    ranks = launch(2, "engines", [t.dir], t.dir.parent / "tiny.py", deadline_s=100)
    _ok(ranks)


@multiproc
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_partitioner_run_engine_pipelining(make_tiny: Callable[..., Tiny]) -> None:
    """`partitioner run --engine pipelining`: the model's losses, and each rank's memory_stats."""
    t = make_tiny(stages=2, schedule="1f1b", microbatches=2)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PIPELINE_TIMEOUT_S": "30"}
    proc = subprocess.run([sys.executable, "-m", "partitioner", "run", "pkg", "--nproc", "2", "--steps", "2", "--lr", "0.1",
                           "--engine", "pipelining"], cwd=t.dir.parent, env=env, capture_output=True, text=True,
                          timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    got = [float(x) for x in re.findall(r"^step \d+  loss (\d+\.\d{6})", out, re.M)]
    model = t.build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    want = []
    for _ in range(2):
        opt.zero_grad()
        loss = t.loss_fn(model(*t.batch()[0]), t.batch()[1])
        loss.backward()
        opt.step()
        want.append(loss.item())
    assert got == pytest.approx(want, rel=1e-5, abs=2e-6), out
    assert re.findall(r"^memory rank (\d)  measured", out, re.M) == ["0", "1"], out


@multiproc
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_torch_engine_runs_1f1b_on_the_gpts(tmp_path: Path) -> None:
    """gpt and the tied GPT, 1f1b on 2 ranks, in one job."""
    _launch(tmp_path, 2, {"1f1b": TWO_RANKS["1f1b"]}, 380)


@multiproc
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_torch_engine_runs_the_other_examples(tmp_path: Path) -> None:
    """The MLP, BERT, NCF, the skip-connection model, HF GPT-2 and HF Llama under gpipe, 1f1b
    and zb-h1 on 2 ranks, in one job.  (On 4 stages, interleaved and zb-v cut BERT's tied
    embedding to a stage two on: a value torch's stages cannot carry, refused with the other
    engine named, `test_a_value_that_skips_a_stage_is_refused_naming_the_other_engine`.)"""
    plans = {k: v for k, v in TWO_RANKS.items() if k in ("gpipe", "1f1b", "zb-h1")}
    _launch(tmp_path, 2, plans, 380, OTHER_EXAMPLES)


@multiproc
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_torch_engine_runs_every_schedule_it_has_on_two_ranks(tmp_path: Path) -> None:
    """gpipe, interleaved (2 ranks x 2 stages), zb-h1, zb-v and zb-h2 (our action list on torch's
    runtime), for gpt and the tied GPT, in one job."""
    plans = {k: v for k, v in TWO_RANKS.items() if k != "1f1b"} | {"zb-h2": dict(stages=2, schedule="zb-h2")}
    _launch(tmp_path, 2, plans, 380)


@multiproc
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_torch_engine_with_ddp_pp2_dp2(tmp_path: Path) -> None:
    """pp 2 x dp 2 on 4 ranks, the replicas by torch's DistributedDataParallel."""
    _launch(tmp_path, 4, {"pp2-dp2": dict(stages=2, dp=2, schedule="1f1b")}, 280)


@multiproc
@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode, n, dp", [("check", 2, 1), ("short", 2, 1), ("train", 4, 2), ("local", 4, 2)])
def test_the_pipeline_api_on_the_torch_engine(make_tiny: Callable[..., Tiny], mode: str, n: int, dp: int) -> None:
    """dist_worker's own modes on engine="pipelining": check (train_step's gradients, pipe(x),
    evaluate, 3 SGD steps), short (the same on a batch of 7 rows: microbatches of 4 and 3),
    train (clip_grad_norm_ and AdamW with ZeRO-1 at dp 2, tied across ranks), local (each
    replica given its own rows, a short batch among them)."""
    t = make_tiny(stages=2, schedule="1f1b", microbatches=2, dp=dp)
    pkg = {"train": _with_zero, "local": _free_batch, "short": _free_batch}.get(mode, lambda d: d)(t.dir)
    env = {"PIPELINE_TEST_ENGINE": "pipelining", "SHORT_ROWS": "7"}
    _ok(launch(n, mode, [pkg], t.dir.parent / "tiny.py", deadline_s=180, env=env))


@multiproc
@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("precision, mode", [("bf16-mixed", "amp"), ("bf16", "amp"), ("fp16-mixed", "scaler")])
def test_precisions_on_the_torch_engine(tmp_path: Path, precision: str, mode: str) -> None:
    """The MLP on 2 ranks of engine="pipelining": bf16-mixed and bf16 (master weights) within the
    precision's noise of the original, and fp16-mixed with runtime.GradScaler skipping an
    overflowing step on every rank (dist_worker's amp and scaler modes)."""
    compile_example(str(ROOT / "examples" / "mlp.py"), tmp_path / "pkg", stages=2, precision=precision)
    copy = tmp_path / "mlp.py"
    shutil.copy(ROOT / "examples" / "mlp.py", copy)
    _ok(launch(2, mode, [tmp_path / "pkg"], copy, deadline_s=180, env={"PIPELINE_TEST_ENGINE": "pipelining"}))


@multiproc
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_tensor_parallel_stages_on_the_torch_engine(tmp_path: Path) -> None:
    """pp 2 x tp 2: the stages' own tp collectives inside torch's schedule, clip_grad_norm_ and
    AdamW against the model (dist_worker's train mode)."""
    pkg = write_tp_package(tmp_path, stages=2, tp=2, dp=1, microbatches=2, schedule="gpipe")
    _ok(launch(4, "train", [pkg], tmp_path / "tp_net.py", deadline_s=180, env={"PIPELINE_TEST_ENGINE": "pipelining"}))


def test_an_unknown_engine_is_refused_before_any_process_group(make_tiny: Callable[..., Tiny]) -> None:
    with pytest.raises(EngineError, match="unknown engine 'torch': the engines are partitioner, pipelining"):
        runtime.DistributedPipeline(make_tiny(stages=2).dir, engine="torch")
    assert check_engine("pipelining") == "pipelining"


def test_a_value_that_skips_a_stage_is_refused_naming_the_other_engine(make_tiny: Callable[..., Tiny]) -> None:
    """The tiny package's `tanh` goes from stage 0 to every later stage: torch's stage sends to
    the next stage only."""
    manifest = package.load_manifest(make_tiny(stages=3).dir)
    with pytest.raises(EngineError, match=r"output 'tanh' goes to stages \[1, 2\].*engine='partitioner'"):
        check_chain(manifest)
    check_chain(package.load_manifest(make_tiny(stages=2).dir))  # A | BCD: a chain (x is a model input)


def test_every_schedule_has_a_torch_runner() -> None:
    from runtime.schedule import SCHEDULES

    for name in SCHEDULES:
        cls, _ = schedule_class(name)
        assert cls.__module__.startswith("torch.distributed.pipelining"), name
    with pytest.raises(EngineError, match="has no torch.distributed.pipelining class.*engine='partitioner'"):
        schedule_class("dualpipe")
