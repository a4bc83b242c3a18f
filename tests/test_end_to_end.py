"""Every example x schedule x stage count: partitioned training equals the original.

Compile, load the original weights, train 3 SGD steps with LocalPipeline, and compare the
losses and every weight with the original model trained the same way (float32, rtol 1e-5).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import runtime
from partitioner.trace import model_file

from .conftest import ANY_PLAN_S, compile_example, train_original, train_pipeline
from .fake_gpu import check_stages_on_fake_gpu

EXAMPLES = ["mlp", "gpt", "bert", "ncf", "skip", "hf_gpt2", "hf_bert"]
STEPS, LR = 3, 0.05


def _reference(path: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The original model trained for STEPS SGD steps on the whole batch (once per example:
    `train_original` caches it for every schedule and stage count)."""
    return train_original(path, STEPS, LR)


def _partitioned(path: str, out: Path, **options: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
    compile_example(path, out, time_limit=ANY_PLAN_S, **options)
    check_stages_on_fake_gpu(out)  # no device constant: every stage runs on a (fake) GPU
    mf = model_file.load(path)
    pipe = runtime.LocalPipeline(str(out))
    pipe.load_state_dict(mf.build(0).state_dict())
    return train_pipeline(pipe, path, STEPS, LR), pipe.state_dict()


#: the larger models' 3-stage GPipe runs are slow (their 3 stages, CP-SAT's plans, run under 1F1B too)
CASES = [pytest.param(example, schedule, stages, marks=pytest.mark.slow)
         if (example, schedule, stages) in {(big, "gpipe", 3) for big in ("bert", "hf_gpt2", "hf_bert")}
         else (example, schedule, stages)
         for example in EXAMPLES for schedule in ("gpipe", "1f1b") for stages in (2, 3)]


@pytest.mark.parametrize("example, schedule, stages", CASES)
def test_training_matches_original(example: str, schedule: str, stages: int, tmp_path: Path) -> None:
    path = f"examples/{example}.py"
    want_losses, want = _reference(path)
    got_losses, got = _partitioned(path, tmp_path / "pkg", stages=stages, schedule=schedule)
    torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(want_losses), rtol=1e-5, atol=1e-6)
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_forward_matches_original(tmp_path: Path) -> None:
    path = "examples/gpt.py"
    compile_example(path, tmp_path / "pkg", stages=3)
    mf = model_file.load(path)
    model = mf.build(0)
    pipe = runtime.LocalPipeline(str(tmp_path / "pkg"))
    pipe.load_state_dict(model.state_dict())
    args, _ = mf.example_inputs()
    with torch.no_grad():
        torch.testing.assert_close(pipe(args), model(*args), rtol=1e-5, atol=1e-6)
