"""Compiled examples under DistributedPipeline: real processes on gloo, against the original.

Tensor parallelism (tp=2 alone, with 2 stages, with 2 replicas) on the GPT example, the
Hugging Face GPT-2 and the BERT-like encoder; the GPT example ties its embedding to the LM
head, so the tied weight lives on two ranks (and is split the same way on both);
each rank checks loss, gradients, forward output and the weights after 3 SGD steps
(tests/runtime/dist_worker.py) to rtol 1e-5.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from .conftest import ANY_PLAN_S, FREE_LINKS as FREE, ROOT, compile_example
from .runtime.test_distributed import _ok, launch


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "name, model, options, ranks",
    [
        ("gpt_2x2_1f1b", "gpt", {"stages": 2, "dp": 2, "schedule": "1f1b"}, 4),
        ("gpt_interleaved", "gpt", {"stages": 2, "schedule": "interleaved", "microbatches": 4}, 2),
        ("skip_3_gpipe", "skip", {"stages": 3, "schedule": "gpipe"}, 3),
        # tp alone: the same rules run again under a pipeline in the "2_stages_x_tp2" cases
        pytest.param("gpt_tp2", "gpt", {"stages": 1, "tp": 2, "hardware": FREE}, 2, marks=pytest.mark.slow),
        ("gpt_2_stages_x_tp2", "gpt", {"stages": 2, "tp": 2, "hardware": FREE}, 4),
        ("gpt_tp2_x_dp2", "gpt", {"stages": 1, "tp": 2, "dp": 2, "hardware": FREE}, 4),
        pytest.param("hf_gpt2_tp2", "hf_gpt2", {"stages": 1, "tp": 2, "hardware": FREE}, 2, marks=pytest.mark.slow),
        ("hf_gpt2_2_stages_x_tp2", "hf_gpt2", {"stages": 2, "tp": 2, "hardware": FREE}, 4),
        pytest.param("bert_tp2", "bert", {"stages": 1, "tp": 2, "hardware": FREE}, 2, marks=pytest.mark.slow),
        ("bert_2_stages_x_tp2", "bert", {"stages": 2, "tp": 2, "schedule": "gpipe", "hardware": FREE}, 4),
    ],
)
def test_compiled_example_trains_like_the_original(name: str, model: str, options: dict[str, object], ranks: int,
                                                   tmp_path: Path) -> None:
    compiled = compile_example(f"examples/{model}.py", tmp_path / name, time_limit=ANY_PLAN_S, **options)
    if options.get("tp", 1) != 1:
        assert compiled.manifest.tensor_parallel["rules"], "the tp tests need something split"
    copy = tmp_path / f"{model}.py"  # the launcher writes its rank logs beside the model file
    shutil.copy(ROOT / "examples" / f"{model}.py", copy)
    _ok(launch(ranks, "check", [tmp_path / name], copy, deadline_s=90))
