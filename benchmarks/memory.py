"""Predicted against measured peak bytes per rank ([Note: the memory walk] in
partitioner/predict/memory.py, [Note: measured memory] in runtime/memory.py).

Each case compiles a model file (analytic costs, a100 profile) and trains it on gloo
ranks: AdamW through `pipe.make_optimizer`, one warm-up step, `opt.zero_grad()`, then one
tracked `train_step` + `opt.step()`; each rank's `pipe.memory_stats()` is gathered and
set beside the plan's prediction for the rank.

    python -m benchmarks.memory
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

import torch

from .common import free_port, save, spawn_ranks, table, update_docs

__all__ = ["CASES", "measure", "main", "tracked_step"]

#: (name, model file, compile options, ranks)
CASES: tuple[tuple[str, str, dict[str, Any], int], ...] = (
    ("gpt 1f1b", "examples/gpt.py", {"stages": 2, "schedule": "1f1b"}, 2),
    ("gpt gpipe", "examples/gpt.py", {"stages": 2, "schedule": "gpipe"}, 2),
    ("gpt interleaved", "examples/gpt.py", {"stages": 2, "schedule": "interleaved", "virtual_stages": 2}, 2),
    ("gpt zb-h1", "examples/gpt.py", {"stages": 2, "schedule": "zb-h1"}, 2),
    ("gpt zb-h2", "examples/gpt.py", {"stages": 2, "schedule": "zb-h2"}, 2),
    ("gpt zb-v", "examples/gpt.py", {"stages": 2, "schedule": "zb-v"}, 2),
    ("gpt 1f1b recompute", "examples/gpt.py", {"stages": 2, "schedule": "1f1b", "recompute": "full"}, 2),
    ("gpt pp2 dp2 zero1", "examples/gpt.py", {"stages": 2, "dp": 2, "zero": 1}, 4),
    ("gpt tp2", "examples/gpt.py", {"stages": 1, "tp": 2}, 2),
    ("gpt bf16-mixed", "examples/gpt.py", {"stages": 2, "precision": "bf16-mixed"}, 2),
    ("mlp 1f1b", "examples/mlp.py", {"stages": 2}, 2),
    ("bert 1f1b", "examples/bert.py", {"stages": 2}, 2),
    ("hf llama 1f1b", "tests/zoo/models/hf_llama.py", {"stages": 2}, 2),
    ("hf llama gpipe", "tests/zoo/models/hf_llama.py", {"stages": 2, "schedule": "gpipe"}, 2),
    ("hf llama zb-h1", "tests/zoo/models/hf_llama.py", {"stages": 2, "schedule": "zb-h1"}, 2),
)


def tracked_step(pipe: Any, inputs: Any, target: Any) -> Any:
    """The step [Note: the memory walk] (partitioner/predict/memory.py) predicts: AdamW,
    one warm-up step (its state made), `zero_grad()` (gradients None), then one tracked
    `train_step` and `opt.step()`; that step's `memory_stats()`."""
    opt = pipe.make_optimizer(torch.optim.AdamW, lr=1e-4)
    for tracked in (False, True):
        opt.zero_grad()
        pipe.track_memory(tracked)
        pipe.train_step(inputs, target)
        opt.step()
    return pipe.memory_stats()


def _worker(rank: int, world: int, port: int, directory: str, model: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(model).parent))  # a zoo model file's helpers beside it
    import torch.distributed as dist

    import runtime
    from partitioner.trace import model_file

    mf = model_file.load(model)
    args, kwargs = mf.example_inputs()
    inputs, target = (kwargs if kwargs else args), mf.example_target()
    pipe = runtime.DistributedPipeline(directory)
    pipe.load_state_dict(mf.build(0).state_dict())
    s = tracked_step(pipe, inputs, target)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {k: getattr(s, k) for k in
                                      ("parameters", "gradients", "optimizer", "activations", "other", "total",
                                       "predicted")})
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def measure(model: str, options: dict[str, Any], ranks: int, work: Path) -> list[dict[str, Any]]:
    """Each rank's measured kinds, total and prediction for `model` compiled with `options`."""
    from driver.compile import compile_model
    from driver.options import CompileOptions

    directory = work / f"pkg{len(list(work.iterdir()))}"
    options = {"microbatches": 4, "analytic": True, "hardware": "a100", "quiet": True, "time_limit": 5.0, **options}
    compile_model(CompileOptions(model=model, out=str(directory), **options))
    out = directory / "measured.json"
    spawn_ranks(_worker, ranks, (ranks, free_port(), str(directory), model, str(out)), deadline_s=300)
    return list(json.loads(out.read_text()))


def _row(name: str, rank: int, r: dict[str, Any]) -> dict[str, Any]:
    return {"case": name, "rank": rank, "measured": r["total"], "predicted": r["predicted"],
            "measured/predicted": r["total"] / r["predicted"] if r["predicted"] else float("nan"),
            **{k: r[k] for k in ("parameters", "gradients", "optimizer", "activations", "other")}}


def main(argv: Sequence[str] | None = None) -> int:
    names = list(argv if argv is not None else sys.argv[1:])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, model, options, ranks in CASES:
            if names and name not in names:
                continue
            for rank, r in enumerate(measure(model, options, ranks, Path(tmp))):
                rows.append(_row(name, rank, r))
                print(rows[-1], file=sys.stderr)
    text = table(rows, ["case", "rank", "measured", "predicted", "measured/predicted", "activations", "other"])
    print(text)
    if not names:
        save("memory", rows)
        update_docs("memory", text, append=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
