"""Our runtime against torch.distributed.pipelining on the same generated stages.

One package is compiled; then, in one gloo process group of S ranks, each rank runs its
stage both ways, alternating step by step so both see the same machine state:

- ours: `runtime.DistributedPipeline(DIR).train_step`
- peer: `torch.distributed.pipelining.PipelineStage` around the same `Stage<k>` module,
  driven by `ScheduleGPipe` / `Schedule1F1B` with the same microbatches and loss.

It reports the median step time of each, their ratio, and the ideal step
(slowest stage's forward+backward per microbatch x (M + S - 1)).  The model is a chain
(each stage reads exactly the previous stage's outputs), as pipelining requires.

    python -m benchmarks.runtime_vs_peer [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .common import load_package, save, table, update_docs

MODEL = "benchmarks/models/pyramid_mlp.py"


def _worker(rank: int, world: int, port: int, directory: str, schedule: str, steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import runtime
    from partitioner.trace import model_file
    from runtime.manifest import read_manifest
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    mf = model_file.load(MODEL)
    original = mf.build(0).state_dict()
    ((x,), _), target, loss_fn = mf.example_inputs(), mf.example_target(), mf.loss_fn()
    ours = runtime.DistributedPipeline(directory)
    ours.load_state_dict(original)
    pkg = load_package(directory)
    module = pkg.load_stage(rank)
    manifest = read_manifest(directory)
    entry = manifest.stages[rank]
    with torch.no_grad():
        for p in entry.parameters:
            getattr(module, p.name).copy_(original[p.source_name])
    microbatches = manifest.microbatches
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    peer = (ScheduleGPipe if schedule == "gpipe" else Schedule1F1B)(stage, microbatches, loss_fn=loss_fn)
    times: dict[str, list[float]] = {"ours": [], "peer": []}
    for step in range(steps + 2):  # two warm-up steps
        for name in ("ours", "peer"):
            dist.barrier()
            start = time.perf_counter()
            if name == "ours":
                ours.train_step((x,), target, loss_fn=loss_fn)
            elif rank == 0:
                peer.step(x)
            elif rank == world - 1:
                peer.step(target=target, losses=[])
            else:
                peer.step()
            dist.barrier()
            if step >= 2:
                times[name].append(time.perf_counter() - start)
    stage_time = _stage_time(module, entry, rank, microbatches, x, loss_fn, target)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, stage_time)
    if rank == 0:
        torch.save({"times": times, "stage_times": gathered}, out)
    dist.destroy_process_group()


def _stage_time(module: torch.nn.Module, entry: dict[str, Any], rank: int, microbatches: int,
                x: torch.Tensor, loss_fn: Any, target: torch.Tensor) -> float:
    """Median forward+backward of this rank's stage on one microbatch, alone."""
    inputs = [torch.randn(i["shape"], requires_grad=i["requires_grad"]) if i["from"] != "input"
              else x[: x.shape[0] // microbatches] for i in entry["inputs"]]
    samples = []
    for _ in range(7):
        start = time.perf_counter()
        out = module(*inputs)
        outs = [out] if isinstance(out, torch.Tensor) else list(out)
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[2:])


def run(schedule: str, stages: int, steps: int, work: Path) -> dict[str, Any]:
    from driver.compile import compile_model
    from driver.options import CompileOptions

    directory = work / f"{schedule}{stages}"
    compile_model(CompileOptions(model=MODEL, out=str(directory), stages=stages, schedule=schedule, quiet=True))
    out = work / f"{schedule}{stages}.pt"
    port = 29600 + stages + (10 if schedule == "gpipe" else 0)
    mp.spawn(_worker, args=(stages, port, str(directory), schedule, steps, str(out)), nprocs=stages, join=True)
    result = torch.load(out)
    ours, peer = statistics.median(result["times"]["ours"]), statistics.median(result["times"]["peer"])
    from runtime.manifest import read_manifest

    m = read_manifest(directory).microbatches
    ideal = max(result["stage_times"]) * (m + stages - 1)
    return {"schedule": schedule, "stages": stages, "microbatches": m, "ours_ms": ours * 1e3, "peer_ms": peer * 1e3,
            "ours_vs_peer": ours / peer, "ideal_ms": ideal * 1e3, "ours_vs_ideal": ours / ideal}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    ns = parser.parse_args(argv)
    steps = 5 if ns.quick else 15
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for schedule in ("gpipe", "1f1b"):
            rows.append(run(schedule, 2, steps, Path(tmp)))
            print(rows[-1], file=sys.stderr)
    text = table(rows, ["schedule", "stages", "microbatches", "ours_ms", "peer_ms", "ours_vs_peer", "ideal_ms", "ours_vs_ideal"])
    print(text)
    save("runtime_vs_peer", rows, model=MODEL)
    update_docs("runtime_vs_peer", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
