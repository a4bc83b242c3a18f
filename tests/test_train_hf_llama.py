"""examples/train_hf_llama.py on 2 ranks through torchrun, started from another working directory:
it compiles through `partitioner.parallelize`, trains, checkpoints, writes a from_pretrained
folder, and a second run reuses the package and resumes from the newest checkpoint."""

from __future__ import annotations

import importlib.util
import os
import shlex
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


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_resume_at_or_past_steps_trains_nothing_and_keeps_the_export(tmp_path: Path) -> None:
    """In one process: --steps is the total, so a second run asking for fewer steps than the
    checkpoint holds exits 2 saying so, and the exported folder is not written again."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PARTITIONER_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, str(SCRIPT), "--analytic", "--save-every", "2", "--eval-every", "2", "--steps"]
    first = subprocess.run([*cmd, "2"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert first.returncode == 0 and "trained 2 steps" in first.stdout, first.stdout[-3000:] + first.stderr[-3000:]
    export = tmp_path / "llama-trained"
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in export.iterdir()}
    again = subprocess.run([*cmd, "1"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    said = " ".join(again.stderr.split())
    assert again.returncode == 2, again.stdout[-3000:] + again.stderr[-3000:]
    assert "checkpoints/step-000002 is at step 2 and --steps 1 is the total" in said and "--steps above 2" in said
    assert "trained" not in again.stdout and "Traceback" not in again.stderr
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in export.iterdir()} == before


def _documented_commands() -> list[list[str]]:
    """The script's arguments in each torchrun command of docs/from-your-script.md, in order."""
    text = (ROOT / "docs" / "from-your-script.md").read_text().replace("\\\n", " ")
    lines = [line.split(" #")[0] for line in text.splitlines() if line.startswith("torchrun ") and SCRIPT.name in line]
    return [shlex.split(line.split(SCRIPT.name, 1)[1]) for line in lines]


def test_the_documented_commands_each_train_something() -> None:
    """docs/from-your-script.md's commands, as the script reads them: one that shares a
    --checkpoints folder with an earlier one asks for a larger total --steps (else it trains
    nothing and exits 2), and none writes another run's --export folder."""
    spec = importlib.util.spec_from_file_location("train_hf_llama", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    commands = _documented_commands()
    reached: dict[str, int] = {}  # checkpoints folder -> the step of its newest checkpoint
    exported: dict[str, str] = {}  # export folder -> the checkpoints folder of the run that wrote it
    for argv in commands:
        args = script.parse_args(argv)
        assert args.steps > reached.get(args.checkpoints, 0), f"{argv} trains nothing after the commands before it"
        assert exported.setdefault(args.export, args.checkpoints) == args.checkpoints, f"{argv} writes another run's export"
        reached[args.checkpoints] = args.steps
    assert len(commands) == 3 and len(reached) == 2
