"""Saving and loading a checkpoint of a ~0.5 GB model: `save_checkpoint` / `load_checkpoint` on
2 and 4 gloo ranks (every rank writes and reads its own stage, in parallel) against
`torch.save` / `torch.load` of the full state_dict in one process.

Time is the slowest rank's (between barriers; the save includes the fsyncs and the atomic
commit; the baseline's torch.save is fsynced too); memory is each rank's peak resident set during the call above its resident set
just before it (sampled every 2 ms from /proc/self/statm), the largest over ranks.

    python -m benchmarks.checkpoint_io [--quick]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from .common import barrier_timed, free_port, save, spawn_ranks, table, update_docs

MODEL = "benchmarks/models/half_gb_mlp.py"
PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def _peak_during(call: Callable[[], Any]) -> tuple[float, int]:
    """(seconds, peak RSS above the start) of call()."""
    base, peak, done = _rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    start = time.perf_counter()
    call()
    seconds = time.perf_counter() - start
    done.set()
    thread.join()
    return seconds, max(peak[0], _rss()) - base


def _worker(rank: int, world: int, port: int, directory: str, where: str, repeats: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), PIPELINE_TIMEOUT_S="600")
    torch.set_num_threads(1)
    import torch.distributed as dist

    import runtime

    pipe = runtime.DistributedPipeline(directory)
    pipe.init_weights(seed=0)
    results: dict[str, list[Any]] = {"save": [], "load": []}
    for i in range(repeats):
        path = Path(where) / f"ck-{i}"
        results["save"].append(_timed(lambda: pipe.save_checkpoint(path)))
        results["load"].append(_timed(lambda: pipe.load_checkpoint(path)))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        torch.save(gathered, out)
    dist.destroy_process_group()


def _timed(call: Callable[[], Any]) -> tuple[float, int]:
    peak = [0]

    def run() -> None:
        peak[0] = _peak_during(call)[1]

    return barrier_timed(run), peak[0]


def _baseline(where: Path, repeats: int) -> dict[str, Any]:
    from partitioner.trace import model_file

    state = model_file.load(MODEL).build(0).state_dict()
    saves, loads = [], []
    for i in range(repeats):
        path = where / f"full-{i}.pt"
        saves.append(_peak_during(lambda: _save_synced(state, path)))
        loads.append(_peak_during(lambda: torch.load(path)))
        path.unlink()
    return _row("torch.save / torch.load", 1, saves, loads, sum(t.numel() * t.element_size() for t in state.values()))


def _save_synced(state: dict[str, torch.Tensor], path: Path) -> None:
    """torch.save, then fsync, as save_checkpoint syncs its files."""
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def _row(how: str, ranks: int, saves: list[tuple[float, int]], loads: list[tuple[float, int]], nbytes: int) -> dict[str, Any]:
    mib = 1 << 20
    return {"how": how, "ranks": ranks, "model_mib": nbytes / mib,
            "save_s": statistics.median(s for s, _ in saves), "save_peak_mib": max(m for _, m in saves) / mib,
            "load_s": statistics.median(s for s, _ in loads), "load_peak_mib": max(m for _, m in loads) / mib}


def run(world: int, repeats: int, tmp: Path) -> dict[str, Any]:
    from driver.compile import compile_model
    from driver.options import CompileOptions

    directory = tmp / f"pkg{world}"
    compile_model(CompileOptions(model=MODEL, out=str(directory), stages=world, analytic=True, hardware="cpu",
                                 quiet=True, time_limit=5.0))
    out = tmp / f"result{world}.pt"
    spawn_ranks(_worker, world, (world, free_port(), str(directory), str(tmp), repeats, str(out)), deadline_s=1800)
    per_rank = torch.load(out)
    # each repeat: the slowest rank's time, the largest rank's memory
    saves = [(max(r["save"][i][0] for r in per_rank), max(r["save"][i][1] for r in per_rank)) for i in range(repeats)]
    loads = [(max(r["load"][i][0] for r in per_rank), max(r["load"][i][1] for r in per_rank)) for i in range(repeats)]
    from partitioner.trace import model_file

    nbytes = sum(p.numel() * p.element_size() for p in model_file.load(MODEL).build(0).parameters())
    return _row("save_checkpoint / load_checkpoint", world, saves, loads, nbytes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    ns = parser.parse_args(argv)
    repeats = 1 if ns.quick else 3
    rows = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("CHECKPOINT_BENCH_DIR")) as name:
        tmp = Path(name)
        rows.append(_baseline(tmp, repeats))
        print(rows[-1], file=sys.stderr)
        for world in (2, 4):
            rows.append(run(world, repeats, tmp))
            print(rows[-1], file=sys.stderr)
    text = table(rows, ["how", "ranks", "model_mib", "save_s", "save_peak_mib", "load_s", "load_peak_mib"])
    text += (f"\n\nMedian of {repeats} per row; time of the slowest rank, memory of the largest (peak resident set "
             f"during the call above the set before it); {os.cpu_count()} CPUs, one local disk.")
    print(text)
    save("checkpoint_io", rows, model=MODEL)
    update_docs("checkpoint_io", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
