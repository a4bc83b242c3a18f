"""Is the mesh `--devices N` chooses the fastest one?  Predicted and measured step time of
every mesh stages x tp x dp = N, on this CPU with N gloo processes.

For N in (2, 4): the model is compiled once with `--devices N --schedule 1f1b` (the
search, costs measured on the spot on the `cpu` profile; one schedule, since the question
is the mesh: benchmarks.schedules compares the schedules) and once per mesh with its
stages, tp and dp fixed (the search then only picks that mesh's microbatch count), and each package is
trained by N `DistributedPipeline` ranks: the median of the timed steps after warm-up,
taken in three rounds over all the meshes in turn (so a drift in the machine's load
touches every mesh alike), a barrier around each step, the barrier's own cost subtracted.  The check: the chosen mesh is
the fastest measured, or within 10% of it.  With N = 4 the 4 ranks share this machine's
2 cores, so every measured step is slower than predicted; the ranking is what is compared.

    python -m benchmarks.mesh_search [--quick] [--devices 2,4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from .common import ROOT, barrier_timed, free_port, profiled_here, save, spawn_ranks, table, update_docs

MODEL = str(ROOT / "benchmarks" / "models" / "wide_mlp.py")
DEADLINE_S = 1200.0


def _compile(out: Path, devices: int, mesh: tuple[int, int, int] | None) -> dict[str, Any]:
    from driver.compile import compile_model
    from driver.options import CompileOptions

    stages, tp, dp = mesh if mesh is not None else (None, None, 1)
    start = time.perf_counter()
    compiled = compile_model(CompileOptions(model=MODEL, out=str(out), devices=devices, stages=stages, tp=tp, dp=dp,
                                            schedule="1f1b", hardware="cpu", quiet=True, time_limit=5.0))
    m = compiled.manifest
    assert m.predicted is not None
    return {"dir": str(out), "pp": m.mesh.pp, "tp": m.mesh.tp, "dp": m.mesh.dp,
            "microbatches": m.microbatches, "predicted_ms": 1e3 * m.predicted.step_time_s,
            "split": len(m.tensor_parallel.get("rules", {})), "compile_s": time.perf_counter() - start}


def _meshes(devices: int) -> list[tuple[int, int, int]]:
    return [(devices // (tp * dp), tp, dp) for tp in range(1, devices + 1) for dp in range(1, devices // tp + 1)
            if devices % (tp * dp) == 0]


# -- measure -----------------------------------------------------------------------------------


def _worker(rank: int, world: int, port: int, dirs: list[str], warmup: int, steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), PIPELINE_TIMEOUT_S="120")
    torch.set_num_threads(1)
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    results = _measure(dirs, warmup, steps)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def _measure(dirs: list[str], warmup: int, steps: int, rounds: int = 3) -> list[dict[str, float]]:
    """Median step of each package, its timed steps taken in `rounds` rounds over all the
    packages in turn, so a drift in the machine's load touches every mesh alike."""

    import runtime
    from runtime import package

    runs = []
    for directory in dirs:
        pipe = runtime.DistributedPipeline(directory)
        model_file = package.load_model_file(pipe.manifest, directory)
        torch.manual_seed(0)
        pipe.load_state_dict(model_file.build_model().state_dict())
        batch = (model_file.example_inputs(), model_file.example_target())
        for _ in range(warmup):
            pipe.train_step(*batch)
        runs.append((pipe, batch))
    empty = statistics.median(barrier_timed(lambda: None) for _ in range(10))
    samples: list[list[float]] = [[] for _ in dirs]
    for _ in range(rounds):
        for (pipe, batch), times in zip(runs, samples):
            times += [barrier_timed(lambda: pipe.train_step(*batch)) for _ in range(max(1, steps // rounds))]
    out = []
    for times in samples:
        ordered = sorted(times)
        median = statistics.median(times)
        out.append({"median_ms": 1e3 * (median - empty),
                    "spread_pct": 100 * (ordered[3 * len(ordered) // 4] - ordered[len(ordered) // 4]) / median})
    return out


def _run(world: int, dirs: list[str], warmup: int, steps: int, work: Path) -> list[dict[str, float]]:
    out = work / f"times-{world}.json"
    spawn_ranks(_worker, world, (world, free_port(), dirs, warmup, steps, str(out)), DEADLINE_S)
    return list(json.loads(out.read_text()))


# -- report --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer timed steps")
    parser.add_argument("--devices", default="2,4", help="comma-separated device counts")
    parser.add_argument("--no-docs", "--no-readme", dest="no_docs", action="store_true", help="do not rewrite the block in docs/benchmarks.md")
    ns = parser.parse_args(argv)
    warmup, steps = (2, 6) if ns.quick else (3, 24)
    rows: list[dict[str, Any]] = []
    verdicts = []
    with profiled_here() as work:  # profiled now, one thread, as the ranks run
        for devices in (int(d) for d in ns.devices.split(",")):
            chosen = _compile(work / f"chosen-{devices}", devices, None)
            cases = []
            for mesh in _meshes(devices):
                try:
                    cases.append(_compile(work / f"mesh-{devices}-{'x'.join(map(str, mesh))}", devices, mesh))
                except Exception as exc:  # a mesh that does not fit or splits nothing
                    print(f"mesh {mesh}: {str(exc).splitlines()[0][:120]}", file=sys.stderr)
            print(f"{devices} devices: chosen pp={chosen['pp']} tp={chosen['tp']} dp={chosen['dp']}; "
                  f"measuring {len(cases)} meshes", file=sys.stderr, flush=True)
            measured = _run(devices, [c["dir"] for c in cases], warmup, steps, work)
            fastest = min(m["median_ms"] for m in measured)
            key = (chosen["pp"], chosen["tp"], chosen["dp"])
            for case, got in zip(cases, measured):
                mine = (case["pp"], case["tp"], case["dp"]) == key
                rows.append({"devices": devices, "pp": case["pp"], "tp": case["tp"], "dp": case["dp"],
                             "microbatches": case["microbatches"], "chosen": "yes" if mine else "",
                             "predicted_ms": case["predicted_ms"], "measured_ms": got["median_ms"],
                             "spread_pct": got["spread_pct"], "vs_fastest": got["median_ms"] / fastest,
                             "tp_nodes_split": case["split"]})
            mine_ms = next((r["measured_ms"] for r in rows if r["devices"] == devices and r["chosen"]), None)
            verdicts.append((devices, None if mine_ms is None else mine_ms / fastest))
    text = table(rows, ["devices", "pp", "tp", "dp", "microbatches", "chosen", "predicted_ms", "measured_ms",
                        "spread_pct", "vs_fastest", "tp_nodes_split"])
    for devices, ratio in verdicts:
        verdict = "not measured" if ratio is None else (
            "the fastest measured" if ratio <= 1.0 + 1e-9 else f"{ratio:.2f}x the fastest measured")
        text += f"\n\n{devices} devices: the chosen mesh is {verdict}."
    text += f"\n\nModel: benchmarks/models/wide_mlp.py; {steps} timed steps after {warmup} warm-up; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs."
    print(text)
    save("mesh_search", rows, verdicts=[{"devices": d, "chosen_vs_fastest": r} for d, r in verdicts])
    if not ns.no_docs:
        update_docs("mesh_search", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
