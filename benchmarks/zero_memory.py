"""Optimizer-state bytes per rank with and without `compile --zero 1` (ZeRO-1), measured
from the optimizer's tensors after one AdamW step, against the planner's prediction.

examples/gpt.py is compiled as one stage replicated dp = 2 and 4 times; each of the dp
gloo ranks builds `pipe.make_optimizer(torch.optim.AdamW)`, takes one step, and counts the
bytes of every tensor in its optimizer's state (torch's ZeroRedundancyOptimizer keeps this
rank's part in `.optim.state`).  The prediction is the memory model's own term: the stage's
parameter bytes x the optimizer-state factor (Adam: 2), / dp with --zero 1
(partitioner/solve/problem.pose).  Adam's per-parameter `step` counters (4 bytes each)
are measured too, and are not in the prediction.

    python -m benchmarks.zero_memory
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .common import free_port, save, spawn_ranks, table, update_docs

MODEL = "examples/gpt.py"


def _worker(rank: int, world: int, port: int, directory: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import runtime
    from partitioner.trace import model_file

    mf = model_file.load(MODEL)
    pipe = runtime.DistributedPipeline(directory)
    pipe.load_state_dict(mf.build(0).state_dict())
    args, kwargs = mf.example_inputs()
    opt = pipe.make_optimizer(torch.optim.AdamW, lr=1e-3)
    pipe.train_step(kwargs if kwargs else args, mf.example_target())
    opt.step()
    state = getattr(opt, "optim", opt).state
    measured = sum(t.numel() * t.element_size() for s in state.values() for t in s.values() if torch.is_tensor(t))
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, measured)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def run(dp: int, zero: int, work: Path) -> dict[str, Any]:
    from driver.compile import compile_model
    from driver.options import CompileOptions
    from partitioner.ir import optimizer_state_factor

    directory = work / f"dp{dp}-zero{zero}"
    compile_model(CompileOptions(model=MODEL, out=str(directory), stages=1, dp=dp, microbatches=2, zero=zero,
                                 analytic=True, hardware="a100", quiet=True, time_limit=5.0))
    out = work / f"dp{dp}-zero{zero}.json"
    spawn_ranks(_worker, dp, (dp, free_port(), str(directory), str(out)), deadline_s=300)
    measured = json.loads(out.read_text())
    from runtime.manifest import read_manifest

    step = read_manifest(directory).predicted
    assert step is not None
    param_bytes = step.stages[0].param_bytes
    predicted = param_bytes * optimizer_state_factor("adam") / (dp if zero else 1)
    return {"dp": dp, "zero": zero, "param_bytes": param_bytes, "measured_min": min(measured),
            "measured_max": max(measured), "predicted": round(predicted), "measured_vs_predicted": max(measured) / predicted,
            "measured_minus_predicted": max(measured) - round(predicted),
            "memory_bytes_predicted": step.stages[0].memory_bytes}


def main(argv: list[str] | None = None) -> int:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for dp in (2, 4):
            for zero in (0, 1):
                rows.append(run(dp, zero, Path(tmp)))
                print(rows[-1], file=sys.stderr)
    text = table(rows, ["dp", "zero", "param_bytes", "measured_min", "measured_max", "predicted",
                        "measured_minus_predicted", "memory_bytes_predicted"])
    print(text)
    save("zero_memory", rows, model=MODEL)
    update_docs("zero_memory", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
