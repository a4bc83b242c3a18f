"""What binding each CPU rank to its own cores buys ([Note: binding CPU ranks to cores] in
runtime/affinity.py).

Every example is compiled into 2 stages (1F1B) and trained on 2 gloo processes with
`DistributedPipeline`, the two conditions interleaved in rounds so that both meet the
VM's slow and fast spells alike (its speed drifts by a fifth over seconds): in each round,
every thread of each rank is bound to the rank's own core (what the runtime does), then
left free to run on any core (`PIPELINE_CPU_BIND=0`), or the other way round on odd
rounds; ROUND_STEPS timed steps of every package per condition and round, a barrier
around each.  `ratio` is the bound median over the free one.

    python -m benchmarks.cpu_binding [--quick] [--examples mlp,gpt]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from .common import free_port, save, spawn_ranks, table, update_readme

EXAMPLES = ("mlp", "gpt", "bert", "ncf", "skip", "hf_gpt2", "hf_bert")
WORLD = 2
ROUND_STEPS = 6
DEADLINE_S = 900.0


def _worker(rank: int, port: int, dirs: list[str], rounds: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), PIPELINE_TIMEOUT_S="60", PIPELINE_CPU_BIND="0")
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from runtime.affinity import bind_threads, cpu_share

    from .simulator_error import _Run

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    free = os.sched_getaffinity(0)
    bound = cpu_share(free, rank, WORLD) or free
    runs = [_Run(rank, d) for d in dirs]
    for run in runs:  # warm-up
        for _ in range(3):
            run.step()
    times: dict[str, dict[str, list[float]]] = {d: {"bound": [], "free": []} for d in dirs}
    for k in range(rounds):
        for condition in ("bound", "free") if k % 2 == 0 else ("free", "bound"):
            bind_threads(bound if condition == "bound" else free)
            for directory, run in zip(dirs, runs):
                run.step()  # the first step after a switch settles the threads
                times[directory][condition] += [1e3 * run.step() for _ in range(ROUND_STEPS)]
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--examples", default=",".join(EXAMPLES), help="comma-separated examples/ names")
    parser.add_argument("--no-readme", action="store_true", help="do not rewrite the README block")
    ns = parser.parse_args(argv)
    if len(os.sched_getaffinity(0)) < WORLD:
        print(f"cpu_binding needs {WORLD} cores to share out; this process may use {len(os.sched_getaffinity(0))}.",
              file=sys.stderr)
        return 1
    rounds = 4 if ns.quick else 12
    examples = [e for e in ns.examples.split(",") if e]
    from partitioner.compiler import CompileOptions, compile_model

    with tempfile.TemporaryDirectory() as tmp:
        dirs = []
        for example in examples:
            directory = str(Path(tmp) / example)
            compile_model(CompileOptions(model=f"examples/{example}.py", out=directory, stages=WORLD,
                                         schedule="1f1b", quiet=True))
            dirs.append(directory)
        out = Path(tmp) / "times.json"
        spawn_ranks(_worker, WORLD, (free_port(), dirs, rounds, str(out)), DEADLINE_S)
        times = json.loads(out.read_text())
    rows: list[dict[str, Any]] = []
    for example, directory in zip(examples, dirs):
        bound, free = (statistics.median(times[directory][c]) for c in ("bound", "free"))
        rows.append({"example": example, "bound_ms": bound, "free_ms": free, "ratio": bound / free,
                     "steps": len(times[directory]["bound"]),
                     "samples_ms": times[directory]})
    text = table(rows, ["example", "bound_ms", "free_ms", "ratio"])
    if rows:
        text += (f"\n\nMedian of {rows[0]['steps']} 1F1B steps per condition (2 stages, 2 gloo processes on "
                 f"{os.cpu_count()} CPUs, one thread each), in {rounds} interleaved rounds; geometric mean ratio "
                 f"{statistics.geometric_mean([r['ratio'] for r in rows]):.2f}.")
    print(text)
    save("cpu_binding", rows, rounds=rounds, round_steps=ROUND_STEPS, cpus=os.cpu_count())
    if not ns.no_readme:
        update_readme("cpu_binding", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
