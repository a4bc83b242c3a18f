"""What the runtime's two CPU settings buy: binding each rank to its own cores ([Note:
binding CPU ranks to cores] in runtime/affinity.py) and keeping freed memory ([Note:
keeping freed memory] in runtime/malloc.py).

Every example is compiled into 2 stages (1F1B) and trained on 2 gloo processes with
`DistributedPipeline`, the two conditions of one A/B interleaved in rounds so that both
meet the VM's slow and fast spells alike (its speed drifts by a fifth over seconds): in
each round, ROUND_STEPS timed steps of every package under one condition, then under the
other (the other way round on odd rounds), a barrier around each step.  The other setting
stays as the runtime has it.

- `binding`: every thread of each rank bound to the rank's own core (what the runtime
  does), or left free to run on any core (`PIPELINE_CPU_BIND=0`); `ratio` = bound / free.
- `malloc`: glibc keeping freed memory (what the runtime does) or its default thresholds
  (`PIPELINE_CPU_MALLOC=0`); `ratio` = kept / default.

    python -m benchmarks.cpu_binding [--quick] [--ab binding,malloc] [--examples mlp,gpt]
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

from .common import free_port, save, spawn_ranks, table, update_docs

EXAMPLES = ("mlp", "gpt", "bert", "ncf", "skip", "hf_gpt2", "hf_bert")
WORLD = 2
ROUND_STEPS = 6
DEADLINE_S = 900.0


#: each A/B's conditions: (the runtime's, the alternative), and the docs/benchmarks.md block it fills
AB = {"binding": (("bound", "free"), "cpu_binding"), "malloc": (("kept", "default"), "cpu_malloc")}


def _set(condition: str, rank: int, allowed: set[int]) -> None:
    """Put this rank in `condition` (one of AB's), the other setting as the runtime has
    it; `allowed`: the cores the process may use."""
    from runtime.affinity import bind_threads, cpu_share
    from runtime.malloc import GLIBC_DEFAULT_BYTES, keep_freed_memory, malloc_thresholds

    bind_threads(allowed if condition == "free" else cpu_share(allowed, rank, WORLD) or allowed)
    if condition == "default":
        malloc_thresholds(GLIBC_DEFAULT_BYTES, GLIBC_DEFAULT_BYTES)
    else:
        keep_freed_memory()


def _worker(rank: int, port: int, dirs: list[str], conditions: tuple[str, str], rounds: int, out: str) -> None:
    # the pipeline itself neither binds nor sets malloc: _set does, per round
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), PIPELINE_TIMEOUT_S="60", PIPELINE_CPU_BIND="0", PIPELINE_CPU_MALLOC="0")
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from .simulator_error import _Run

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    allowed = os.sched_getaffinity(0)
    runs = [_Run(rank, d) for d in dirs]
    _set(conditions[0], rank, allowed)
    for run in runs:  # warm-up
        for _ in range(3):
            run.step()
    times: dict[str, dict[str, list[float]]] = {d: {c: [] for c in conditions} for d in dirs}
    for k in range(rounds):
        for condition in conditions if k % 2 == 0 else conditions[::-1]:
            _set(condition, rank, allowed)
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
    parser.add_argument("--ab", default=",".join(AB), help=f"which A/Bs, of {', '.join(AB)}")
    parser.add_argument("--no-docs", "--no-readme", dest="no_docs", action="store_true", help="do not rewrite the block in docs/benchmarks.md")
    ns = parser.parse_args(argv)
    unknown = sorted(set(a for a in ns.ab.split(",") if a) - set(AB))
    if unknown:
        parser.error(f"--ab {', '.join(unknown)}: choose from {', '.join(AB)}")
    if len(os.sched_getaffinity(0)) < WORLD:
        print(f"cpu_binding needs {WORLD} cores to share out; this process may use {len(os.sched_getaffinity(0))}.",
              file=sys.stderr)
        return 1
    rounds = 4 if ns.quick else 12
    examples = [e for e in ns.examples.split(",") if e]
    from driver.compile import compile_model
    from driver.options import CompileOptions

    with tempfile.TemporaryDirectory() as tmp:
        dirs = []
        for example in examples:
            directory = str(Path(tmp) / example)
            compile_model(CompileOptions(model=f"examples/{example}.py", out=directory, stages=WORLD,
                                         schedule="1f1b", quiet=True))
            dirs.append(directory)
        for ab in [a for a in ns.ab.split(",") if a]:
            (ours, other), name = AB[ab]
            out = Path(tmp) / f"{ab}.json"
            spawn_ranks(_worker, WORLD, (free_port(), dirs, (ours, other), rounds, str(out)), DEADLINE_S)
            times = json.loads(out.read_text())
            rows: list[dict[str, Any]] = []
            for example, directory in zip(examples, dirs):
                a, b = (statistics.median(times[directory][c]) for c in (ours, other))
                rows.append({"example": example, f"{ours}_ms": a, f"{other}_ms": b, "ratio": a / b,
                             "steps": len(times[directory][ours]), "samples_ms": times[directory]})
            text = table(rows, ["example", f"{ours}_ms", f"{other}_ms", "ratio"])
            if rows:
                text += (f"\n\nMedian of {rows[0]['steps']} 1F1B steps per condition (2 stages, 2 gloo processes "
                         f"on {os.cpu_count()} CPUs, one thread each), in {rounds} interleaved rounds; geometric mean "
                         f"ratio {statistics.geometric_mean([r['ratio'] for r in rows]):.2f}.")
            print(text)
            save(name, rows, rounds=rounds, round_steps=ROUND_STEPS, cpus=os.cpu_count(), conditions=[ours, other])
            if not ns.no_docs:
                update_docs(name, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
