"""examples/train_hf_llama.py on 2 ranks through torchrun, started from another working directory:
it compiles through `partitioner.parallelize`, trains, checkpoints, writes a from_pretrained
folder, and a second run reuses the package and resumes from the newest checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT

SCRIPT = ROOT / "examples" / "train_hf_llama.py"


def _torchrun(cwd: Path, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PARTITIONER_CACHE": str(cwd / "cache"),
           "PIPELINE_TIMEOUT_S": "60"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
           "--analytic", "--save-every", "2", "--eval-every", "2", *args]
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_trains_resumes_and_exports_from_another_folder(tmp_path: Path) -> None:
    first = _torchrun(tmp_path, "--steps", "4")
    assert "trained 4 steps" in first
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    second = _torchrun(tmp_path, "--steps", "6")
    assert "reusing the package" in second
    assert "resumed from checkpoints/step-000004 at step 4" in second and "trained 6 steps" in second
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tmp_path / "llama-trained")
    assert model.config.vocab_size == 256
