"""Compiled examples under DistributedPipeline: real processes on gloo, against the original.

The GPT example ties its embedding to the LM head, so the tied weight lives on two ranks;
each rank checks loss, gradients, forward output and the weights after 3 SGD steps
(tests/runtime/dist_worker.py) to rtol 1e-5.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from .conftest import ROOT, compile_example
from .runtime.test_distributed import _ok, launch


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "name, options, ranks",
    [
        ("gpt_2x2_1f1b", {"stages": 2, "dp": 2, "schedule": "1f1b"}, 4),
        ("gpt_interleaved", {"stages": 2, "schedule": "interleaved", "microbatches": 4}, 2),
        ("skip_3_gpipe", {"stages": 3, "schedule": "gpipe"}, 3),
    ],
)
def test_compiled_example_trains_like_the_original(name: str, options: dict[str, object], ranks: int, tmp_path: Path) -> None:
    model = "gpt" if name.startswith("gpt") else "skip"
    compile_example(f"examples/{model}.py", tmp_path / name, **options)
    copy = tmp_path / f"{model}.py"  # the launcher writes its rank logs beside the model file
    shutil.copy(ROOT / "examples" / f"{model}.py", copy)
    _ok(launch(ranks, "check", [tmp_path / name], copy, deadline_s=90))
