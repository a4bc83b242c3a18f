"""Zero-bubble schedules against 1F1B on 2 gloo ranks (one core each), measured and predicted.

Each model is compiled once per schedule (2 ranks: 2 stages, or 4 in a V under zb-v; M = 4;
costs profiled here); in one
process group the ranks then hold one `DistributedPipeline` per schedule and step them in
turn, round after round, so every schedule sees the same machine state.  Reported: the
median step of each schedule over 1F1B's, beside the ratio the compiler predicted (the
manifests' `predicted.step_time_s`).  With 2 stages and M = 4, 1F1B idles a fifth of the
step ((S - 1) / (M + S - 1)); ZB-H1 cuts that to a third on equal F, I and W, ZB-V to a
sixth (its stages half as long, each rank's two in a V: runtime/zero_bubble.py).

    python -m benchmarks.schedules [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .common import free_port, profiled_here, save, spawn_ranks, table, update_docs

MODELS = ("benchmarks/models/wide_mlp.py", "examples/gpt.py")
SCHEDULES = ("1f1b", "zb-h1", "zb-h2", "zb-v")
STAGES, MICROBATCHES = 2, 4  # pipeline ranks (--stages; zb-v runs 2 stages on each)


def _worker(rank: int, port: int, model: str, dirs: dict[str, str], rounds: int, steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(STAGES),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=STAGES)
    import runtime
    from partitioner.trace import model_file

    from .common import barrier_timed

    mf = model_file.load(model)
    args, kwargs = mf.example_inputs()
    inputs, target = (kwargs if kwargs else args), mf.example_target()
    pipes = {s: runtime.DistributedPipeline(d) for s, d in dirs.items()}
    for pipe in pipes.values():
        pipe.load_state_dict(mf.build(0).state_dict())
    times: dict[str, list[float]] = {s: [] for s in pipes}
    for r in range(rounds + 1):  # round 0 warms up
        for s, pipe in pipes.items():
            for _ in range(steps):
                t = barrier_timed(lambda: pipe.train_step(inputs, target))
                if r:
                    times[s].append(t)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def _predicted_step(directory: Path) -> float:
    """The package's predicted step time, as its manifest records it."""
    from runtime.manifest import read_manifest

    step = read_manifest(directory).predicted
    assert step is not None
    return step.step_time_s


def run(model: str, work: Path, rounds: int, steps: int) -> list[dict[str, Any]]:
    from driver.compile import compile_model
    from driver.options import CompileOptions

    dirs, predicted = {}, {}
    for s in SCHEDULES:
        d = work / f"{Path(model).stem}-{s}"
        compile_model(CompileOptions(model=model, out=str(d), stages=STAGES, microbatches=MICROBATCHES,
                                     schedule=s, quiet=True))
        dirs[s] = str(d)
        predicted[s] = _predicted_step(d)
    out = work / f"{Path(model).stem}.json"
    spawn_ranks(_worker, STAGES, (free_port(), model, dirs, rounds, steps, str(out)), deadline_s=1200)
    times = json.loads(out.read_text())
    base = statistics.median(times["1f1b"])
    return [{"model": Path(model).stem, "schedule": s, "step_ms": statistics.median(times[s]) * 1e3,
             "vs_1f1b": statistics.median(times[s]) / base, "predicted_vs_1f1b": predicted[s] / predicted["1f1b"]}
            for s in SCHEDULES]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    ns = parser.parse_args(argv)
    rounds, steps = (3, 4) if ns.quick else (8, 8)
    rows: list[dict[str, Any]] = []
    with profiled_here() as work:
        for model in MODELS:
            rows += run(model, work, rounds, steps)
            print(rows[-len(SCHEDULES):], file=sys.stderr)
    text = table(rows, ["model", "schedule", "step_ms", "vs_1f1b", "predicted_vs_1f1b"])
    text += (f"\n\nMedian of {rounds * steps} steps per schedule ({STAGES} stages, zb-v {2 * STAGES} in a V; "
             f"M = {MICROBATCHES}, {STAGES} gloo processes, one thread each), the schedules taking turns in {rounds} "
             f"rounds.")
    print(text)
    save("schedules", rows, models=list(MODELS))
    update_docs("schedules", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
