"""examples/train_gpt.py, the training script a user writes, on 2 gloo ranks: its loss falls,
through the last batch of an epoch (short), eval mode, clipping and accumulation, under bf16
autocast (compiled with --precision bf16-mixed); and
`partitioner run` trains the same package on the model file's batches() with AdamW."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT, compile_example

SCRIPT = ROOT / "examples" / "train_gpt.py"


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TRAIN_GPT_SIZE": "small"}


@pytest.mark.multiproc
def test_train_gpt_learns_on_two_ranks(tmp_path: Path) -> None:
    """Compiled with --precision bf16-mixed: bf16 autocast trained end to end."""
    compiled = compile_example(str(SCRIPT), tmp_path / "pkg", stages=2, precision="bf16-mixed")
    assert compiled.manifest.precision == "bf16-mixed"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(SCRIPT),
           str(tmp_path / "pkg"), "--steps", "50", "--eval-every", "25"]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = [float(x) for x in re.search(r"eval loss: (.*)", proc.stdout).group(1).split()]  # type: ignore[union-attr]
    assert len(evals) == 3 and evals[-1] < evals[0] - 1.0, evals
    assert re.search(r"\(([1-9]\d*) short batches\)", proc.stdout), proc.stdout


@pytest.mark.multiproc
def test_partitioner_run_takes_the_model_files_batches(tmp_path: Path) -> None:
    compile_example(str(SCRIPT), tmp_path / "pkg", stages=2)
    cmd = [sys.executable, "-m", "partitioner", "run", str(tmp_path / "pkg"), "--nproc", "2", "--steps", "6",
           "--optimizer", "adamw", "--lr", "3e-3", "--clip", "1.0"]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", proc.stdout)]
    assert len(losses) == 6 and losses[-1] < losses[0], losses
