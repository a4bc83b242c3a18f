"""Split quality on large-vocabulary transformers: our measured slowest stage against the
splits users get elsewhere (torchtitan's even split, DeepSpeed's `parameters`).

For Hugging Face GPT-2, Llama and BERT with their real vocabularies and 8 layers
(`benchmarks/models/hf_*_big.py`) and S = 2, 3, 4 stages, four packages are emitted from
one trace and each stage is timed alone on a real microbatch (forward + backward, on a
rank's one thread; the last stage also runs the loss, timed by the compile):

- ours:       the compile's plan (measured costs, the loss charged to the last stage,
              checked against the machine and re-solved where it was off)
- torchtitan: layers split evenly, the embedding and the head counted as one layer each
- parameters: DeepSpeed's partition_method='parameters' (balanced parameter counts)
- best:       the best contiguous split by the layers' own measured times (exact DP)

`best_vs_torchtitan` is what any contiguous split gains on torchtitan's: where the LM head
and its loss outweigh the layers, little.  Stages are timed with freed memory kept, as a
rank keeps it (runtime/malloc.py).

Each time is the median over interleaved rounds (every variant timed once per round, a
different one first each round), and each ratio the median of the ratios within a round:
this 2-core machine is shared and noisy (~10%).

    python -m benchmarks.split_quality [--quick]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

from driver.compile import compile_model
from driver.options import CompileOptions
from driver.phases import assign_nodes, prepare
from driver.prepared import Prepared

from .common import publish, stage_sweep
from .partition_quality import _node, by_layers, layers, measure_stages, split_balanced

MODELS = ["benchmarks/models/hf_gpt2_big.py", "benchmarks/models/hf_llama_big.py", "benchmarks/models/hf_bert_big.py"]


def units(prepared: Prepared) -> list[list[str]]:
    """The model's layers as torchtitan counts them: the embedding (everything before the
    first numbered layer) one unit, each layer one, the head (everything after) one."""
    groups = layers(prepared)
    numbered = [i for i, g in enumerate(groups) if any(part.isdigit() for part in _module(prepared, g).split("."))]
    first, last = numbered[0], numbered[-1]
    head = [n for g in groups[last + 1:] for n in g]
    emb = [n for g in groups[:first] for n in g]
    return ([emb] if emb else []) + groups[first:last + 1] + ([head] if head else [])


def _module(prepared: Prepared, group: list[str]) -> str:
    from partitioner.trace.passes import node_module

    return next((node_module(_node(prepared, n)) for n in group if node_module(_node(prepared, n))), "")


def even(n: int, parts: int) -> list[int]:
    """torchtitan's even split of n units into parts: boundaries."""
    return [round(i * n / parts) for i in range(parts + 1)]


def run_model(path: str, stages: int, rounds: int, repeats: int, work: Path) -> dict[str, Any]:
    compile_model(CompileOptions(model=path, out=str(work / "ours"), stages=stages, quiet=True, time_limit=10))
    prepared = prepare(CompileOptions(model=path, out=str(work / "x"), stages=stages, quiet=True))
    loss_s = prepared.loss.time_s if prepared.loss is not None else 0.0
    groups = units(prepared)
    params = {name: p.numel() for name, p in prepared.traced.gm.named_parameters()}
    weights = [float(sum(params.get(a.target, 0) for n in g for a in _node(prepared, n).all_input_nodes
                         if a.op == "get_attr")) for g in groups]
    prepared.opts.out = str(work / "each")
    assign_nodes(prepared, by_layers(groups, list(range(len(groups) + 1))))
    per_unit = [statistics.median(x) for x in zip(*(measure_stages(work / "each", prepared, repeats)
                                                     for _ in range(rounds)))]
    per_unit[-1] += loss_s
    splits = {"torchtitan": even(len(groups), stages), "parameters": split_balanced(weights, stages),
              "best": split_balanced(per_unit, stages)}
    for name, bounds in splits.items():
        prepared.opts.out = str(work / name)
        assign_nodes(prepared, by_layers(groups, bounds))
    slowest: dict[str, list[float]] = {name: [] for name in ["ours", *splits]}
    for k in range(rounds):  # interleaved: every variant once per round, in turn first
        names = list(slowest)
        for name in names[k % len(names):] + names[:k % len(names)]:
            times = measure_stages(work / name, prepared, repeats)
            times[-1] += loss_s
            slowest[name].append(max(times))
    row: dict[str, Any] = {"model": Path(path).stem.removesuffix("_big"), "stages": stages, "units": len(groups)}
    for name, samples in slowest.items():
        row[f"{name}_ms"] = statistics.median(samples) * 1e3
    for other in splits:  # the median of the ratios within each round: the machine's drift cancels
        row[f"ours_vs_{other}"] = statistics.median(a / b for a, b in zip(slowest["ours"], slowest[other]))
    # what any contiguous split can gain on torchtitan's: where the head dominates, little
    row["best_vs_torchtitan"] = statistics.median(a / b for a, b in zip(slowest["best"], slowest["torchtitan"]))
    print(f"{row['model']} S={stages}: ours {row['ours_ms']:.2f} ms, best {row['best_ms']:.2f}, "
          f"torchtitan {row['torchtitan_ms']:.2f}, parameters {row['parameters_ms']:.2f}", file=sys.stderr)
    return row


def main(argv: list[str] | None = None) -> int:
    rows = stage_sweep(argv, __doc__, MODELS, [2, 3, 4], run_model)
    publish("split_quality", rows, ["model", "stages", "units", "ours_ms", "best_ms", "torchtitan_ms", "parameters_ms",
                                    "ours_vs_best", "ours_vs_torchtitan", "ours_vs_parameters", "best_vs_torchtitan"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
