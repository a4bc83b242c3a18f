"""The two engines on the same package: our runtime against torch.distributed.pipelining.

For each schedule both engines run (gpipe, 1f1b, interleaved with 2 stages per rank, zb-h1,
zb-v) and each rank count, one package of the pyramid MLP is compiled; then, in one gloo
process group, every rank builds it twice, `runtime.DistributedPipeline(DIR)` (engine
"partitioner") and `runtime.DistributedPipeline(DIR, engine="pipelining")`, from the same
weights, and trains both on the same batch in rounds, the two engines alternating step by
step so that both see the same machine state.  It reports the ratio of the median steps
(pipelining / partitioner) and the range of the per-round ratios: ratios only, as the times
themselves are those of a shared machine.

    python -m benchmarks.runtime_vs_peer [--quick]      (--quick: 2 ranks, 3 rounds)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from .common import ROOT, barrier_timed, free_port, publish, spawn_ranks, table, update_docs

MODEL = "benchmarks/models/pyramid_mlp.py"
ENGINES = ("partitioner", "pipelining")
#: schedule -> compile options on R ranks
PLANS = {"gpipe": {}, "1f1b": {}, "interleaved": {"virtual_stages": 2}, "zb-h1": {}, "zb-v": {}}


def _worker(rank: int, world: int, port: int, directory: str, rounds: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import runtime
    from partitioner.trace import model_file

    mf = model_file.load(MODEL)
    original = mf.build(0).state_dict()
    (inputs, _), target = mf.example_inputs(), mf.example_target()
    pipes = {e: runtime.DistributedPipeline(directory, engine=e) for e in ENGINES}
    opts = {}
    for e, pipe in pipes.items():
        pipe.load_state_dict(original)
        opts[e] = pipe.make_optimizer(torch.optim.SGD, lr=1e-4)
    times: dict[str, list[float]] = {e: [] for e in ENGINES}
    for step in range(rounds + 1):  # one warm-up round
        for e, pipe in pipes.items():
            def one() -> None:
                opts[e].zero_grad()
                pipe.train_step(inputs, target)
                opts[e].step()
            took = barrier_timed(one)
            if step:
                times[e].append(took)
    if rank == 0:
        torch.save(times, out)


def run(schedule: str, ranks: int, rounds: int, work: Path) -> dict[str, Any]:
    from driver.compile import compile_model
    from driver.options import CompileOptions

    directory = work / f"{schedule}-{ranks}"  # --stages: the pipeline ranks (virtual stages on top)
    compile_model(CompileOptions(model=MODEL, out=str(directory), stages=ranks, schedule=schedule, quiet=True,
                                 analytic=True, hardware="a100", **PLANS[schedule]))
    out = work / f"{schedule}-{ranks}.pt"
    spawn_ranks(_worker, ranks, (ranks, free_port(), str(directory), rounds, str(out)), deadline_s=600)
    times = torch.load(out)
    ratios = [t / o for t, o in zip(times["pipelining"], times["partitioner"])]
    return {"schedule": schedule, "ranks": ranks, "rounds": rounds,
            "pipelining_vs_partitioner": statistics.median(times["pipelining"]) / statistics.median(times["partitioner"]),
            "lowest_round": min(ratios), "highest_round": max(ratios)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="2 ranks only, 3 rounds")
    ns = parser.parse_args(argv)
    rounds, counts = (3, (2,)) if ns.quick else (10, (2, 4))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in counts:
            for schedule in PLANS:
                rows.append(run(schedule, ranks, rounds, Path(tmp)))
                print(rows[-1], file=sys.stderr)
    columns = ["schedule", "ranks", "rounds", "pipelining_vs_partitioner", "lowest_round", "highest_round"]
    publish("runtime_vs_peer", rows, columns)
    update_docs("engines", table(rows, columns), page=ROOT / "docs" / "engines.md")  # the engines' own page
    return 0


if __name__ == "__main__":
    sys.exit(main())
