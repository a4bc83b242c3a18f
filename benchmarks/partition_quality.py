"""Partition quality: the measured slowest stage of our plan against the alternatives.

For each model with uneven layers and each stage count S, four packages are emitted from
one trace and their stages timed on real microbatches (forward + backward, median):

- ours:       the solver's plan (measured node costs, coarsened DAG, DP + CP-SAT)
- optimum:    the best contiguous split at layer granularity, by the layers' own measured
              times (every layer emitted as its own stage and timed, then exact DP)
- uniform:    DeepSpeed PipelineModule partition_method='uniform' (equal layers per stage)
- parameters: DeepSpeed partition_method='parameters' (balanced parameter counts)

Stages are timed on one thread, as a rank computes them (`partitioner.cost.measure.rank_threads`)
and as the compile measured its costs.  It also times the compile of a 48-layer GPT,
profiling included.

    python -m benchmarks.partition_quality [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from driver.compile import compile_model
from driver.options import CompileOptions
from driver.phases import assign_nodes, prepare
from driver.prepared import Prepared
from partitioner.cost.nodes import compute_nodes
from partitioner.cost.measure import rank_threads
from partitioner.trace.passes import node_module
from runtime.malloc import keep_freed_memory
from runtime.manifest import read_manifest

from .common import load_package, save, table, update_docs

MODELS = ["benchmarks/models/pyramid_mlp.py", "benchmarks/models/uneven_transformer.py"]


# -- layers and the baselines' splits ----------------------------------------------------


def layers(prepared: Prepared) -> list[list[str]]:
    """Compute nodes grouped into layers: consecutive nodes of one module down to its index."""

    def key(path: str) -> str:
        parts = path.split(".")
        index = next((i for i, p in enumerate(parts) if p.isdigit()), None)
        return ".".join(parts[: index + 1]) if index is not None else parts[0]

    groups: list[list[str]] = []
    last = None
    for node in compute_nodes(prepared.traced.gm):
        k = key(node_module(node))
        if groups and (k == last or k == ""):
            groups[-1].append(node.name)
        else:
            groups.append([node.name])
            last = k
    return groups


def split_uniform(n: int, parts: int) -> list[int]:
    """DeepSpeed's partition_uniform: boundaries giving each part n/parts items."""
    return [round(i * n / parts) for i in range(parts + 1)]


def split_balanced(weights: Sequence[float], parts: int) -> list[int]:
    """Contiguous split of `weights` minimising the heaviest part (exact DP), as boundaries.

    DeepSpeed's partition_balanced does the same on parameter counts by binary search.
    """
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for p in range(1, parts + 1):
        for j in range(p, n + 1):
            for i in range(p - 1, j):
                v = max(best[p - 1][i], prefix[j] - prefix[i])
                if v < best[p][j]:
                    best[p][j], cut[p][j] = v, i
    bounds = [n]
    for p in range(parts, 0, -1):
        bounds.append(cut[p][bounds[-1]])
    return bounds[::-1]


def by_layers(groups: list[list[str]], bounds: list[int]) -> dict[str, int]:
    return {n: k for k in range(len(bounds) - 1) for g in groups[bounds[k] : bounds[k + 1]] for n in g}


# -- measuring emitted stages ------------------------------------------------------------


def measure_stages(directory: Path, prepared: Prepared, repeats: int) -> list[float]:
    """Median forward+backward seconds of each stage on microbatch 0, with freed memory kept
    as a rank keeps it (runtime/malloc.py): else a stage's large buffers are faulted in
    again or not depending on what ran before it in this process."""
    keep_freed_memory()
    pkg = load_package(directory)
    manifest = read_manifest(directory)
    state = prepared.model.state_dict()
    aliases = {v: k for k, v in manifest.state_dict_aliases.items()}
    from driver.options import split_batch

    args, kwargs = split_batch(prepared.args, prepared.kwargs, prepared.mf.leaf_batch_dims(prepared.model, prepared.args, prepared.kwargs), prepared.rows)
    given = {**dict(enumerate(args)), **kwargs}
    batch = {i.name: given[i.key] for i in manifest.inputs}
    values: dict[str, torch.Tensor] = {}
    times = []
    for entry in manifest.stages:
        stage = pkg.load_stage(entry.index)
        with torch.no_grad():
            for p in entry.parameters:
                src = p.source_name
                getattr(stage, p.name).copy_(state[src] if src in state else state[aliases[src]])
        inputs = [batch[i.name] if i.from_batch else values[i.name].detach().requires_grad_(i.requires_grad)
                  for i in entry.inputs]

        def step() -> Any:
            out = stage(*inputs)
            leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            torch.autograd.backward(leaves, [torch.ones_like(t) for t in leaves])
            return out

        out = step()
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            step()
            samples.append(time.perf_counter() - start)
        times.append(statistics.median(samples))
        if entry["outputs"][0]["to"] != "output":
            for o, v in zip(entry["outputs"], out):
                values[o["name"]] = v.detach()
    return times


# -- the benchmark -----------------------------------------------------------------------


def run_model(path: str, stages: int, repeats: int, work: Path) -> dict[str, Any]:
    opts = CompileOptions(model=path, out=str(work / "ours"), stages=stages, quiet=True, time_limit=10)
    start = time.perf_counter()
    compiled = compile_model(opts)
    compile_s = time.perf_counter() - start
    prepared = prepare(CompileOptions(model=path, out=str(work / "x"), stages=stages, quiet=True))
    groups = layers(prepared)
    params = {name: p.numel() for name, p in prepared.traced.gm.named_parameters()}
    layer_params = [sum(params.get(a.target, 0) for n in g for a in _node(prepared, n).all_input_nodes if a.op == "get_attr")
                    for g in groups]
    result: dict[str, Any] = {"model": Path(path).stem, "stages": stages, "layers": len(groups),
                              "nodes": len(compute_nodes(prepared.traced.gm)), "compile_s": compile_s}
    result["ours_ms"] = max(measure_stages(work / "ours", prepared, repeats)) * 1e3
    prepared.opts.out = str(work / "each")
    assign_nodes(prepared, by_layers(groups, list(range(len(groups) + 1))))
    layer_times = measure_stages(work / "each", prepared, repeats)
    splits = {
        "optimum": split_balanced(layer_times, stages),
        "uniform": split_uniform(len(groups), stages),
        "parameters": split_balanced([float(p) for p in layer_params], stages),
    }
    for name, bounds in splits.items():
        prepared.opts.out = str(work / name)
        assign_nodes(prepared, by_layers(groups, bounds))
        result[f"{name}_ms"] = max(measure_stages(work / name, prepared, repeats)) * 1e3
    result["ours_vs_optimum"] = result["ours_ms"] / result["optimum_ms"]
    result["speedup_vs_uniform"] = result["uniform_ms"] / result["ours_ms"]
    result["speedup_vs_parameters"] = result["parameters_ms"] / result["ours_ms"]
    result["predicted_ms"] = max(s.time_s for s in compiled.plan.stages) * 1e3
    return result


def _node(prepared: Prepared, name: str) -> torch.fx.Node:
    return next(n for n in prepared.traced.gm.graph.nodes if n.name == name)


def compile_time_gpt48(work: Path) -> dict[str, Any]:
    """Compile the 48-layer GPT with profiling from scratch (fresh profile cache)."""
    import os

    os.environ["PARTITIONER_CACHE"] = str(work / "cache")
    opts = CompileOptions(model="examples/gpt48.py", out=str(work / "gpt48"), stages=8, quiet=True, time_limit=10)
    start = time.perf_counter()
    compiled = compile_model(opts)
    total = time.perf_counter() - start
    nodes = len(compute_nodes(compiled.traced.gm))
    report = compiled.plan.report
    return {"model": "gpt48", "nodes": nodes, "stages": 8, "compile_s": total,
            **{f"{k}_s": v for k, v in compiled.timings.items()},
            "solver": report.method if report else "", "gap": report.gap if report else 0.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repeats, S=2 only")
    ns = parser.parse_args(argv)
    repeats = 5 if ns.quick else 15
    rows = []
    with tempfile.TemporaryDirectory() as tmp, rank_threads():
        for path in MODELS:
            for stages in ([2] if ns.quick else [2, 4]):
                row = run_model(path, stages, repeats, Path(tmp) / f"{Path(path).stem}{stages}")
                rows.append(row)
                print(f"{row['model']} S={stages}: ours {row['ours_ms']:.2f} ms, optimum {row['optimum_ms']:.2f}, "
                      f"uniform {row['uniform_ms']:.2f}, parameters {row['parameters_ms']:.2f}", file=sys.stderr)
        gpt = compile_time_gpt48(Path(tmp))
    cols = ["model", "stages", "layers", "ours_ms", "optimum_ms", "uniform_ms", "parameters_ms",
            "ours_vs_optimum", "speedup_vs_uniform", "speedup_vs_parameters", "compile_s"]
    text = table(rows, cols)
    gpt_text = table([gpt], ["model", "nodes", "stages", "compile_s", "trace_s", "cost_s", "solve_s", "emit_s", "solver", "gap"])
    print(text + "\n\n" + gpt_text)
    save("partition_quality", rows, compile_time=gpt)
    update_docs("partition_quality", text + "\n\nCompile time, profiling included (fresh cache):\n\n" + gpt_text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
