"""Stage balance on transformers nobody here wrote (an outside check of the planner).

Small Hugging Face Qwen2, Llama with a tied head, Mistral and BART
(`benchmarks/models/hf_small.py`) are compiled with measured costs into 2 and 3 stages, and
each emitted stage is timed alone on a real microbatch (forward + backward on a rank's one
thread; the last stage also runs the loss, as the compile timed it).  The figure is the
slowest stage over the mean stage; the goal is at most 1.2.  Each is the median over
rounds, the stage times of one round taken together.

    python -m benchmarks.stage_balance [--quick]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

from driver.compile import compile_model
from driver.options import CompileOptions
from driver.phases import prepare
from runtime.manifest import read_manifest

from .common import publish, stage_sweep
from .partition_quality import measure_stages

MODELS = ["benchmarks/models/hf_qwen2_small.py", "benchmarks/models/hf_llama_tied_small.py",
          "benchmarks/models/hf_mistral_small.py", "benchmarks/models/hf_bart_small.py"]
GOAL = 1.2


def run_model(path: str, stages: int, rounds: int, repeats: int, work: Path) -> dict[str, Any]:
    compile_model(CompileOptions(model=path, out=str(work), stages=stages, quiet=True, time_limit=10))
    prepared = prepare(CompileOptions(model=path, out=str(work / "x"), stages=stages, quiet=True))
    loss_s = prepared.loss.time_s if prepared.loss is not None else 0.0
    samples = []
    for _ in range(rounds):
        times = measure_stages(work, prepared, repeats)
        times[-1] += loss_s
        samples.append(times)
    per_stage = [statistics.median(s) for s in zip(*samples)]
    ratios = [max(t) / statistics.fmean(t) for t in samples]
    manifest = read_manifest(work)
    row: dict[str, Any] = {"model": Path(path).stem.removesuffix("_small"), "stages": stages,
                           "nodes": "/".join(str(s.nodes) for s in manifest.stages),
                           "stage_ms": "/".join(f"{t * 1e3:.2f}" for t in per_stage),
                           "slowest_over_mean": statistics.median(ratios)}
    row["within_goal"] = row["slowest_over_mean"] <= GOAL
    print(f"{row['model']} S={stages}: stages {row['stage_ms']} ms, slowest/mean {row['slowest_over_mean']:.3f}",
          file=sys.stderr)
    return row


def main(argv: list[str] | None = None) -> int:
    rows = stage_sweep(argv, __doc__, MODELS, [2, 3], run_model)
    publish("stage_balance", rows, ["model", "stages", "nodes", "stage_ms", "slowest_over_mean", "within_goal"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
