"""Solver scaling: coarsen, DP and CP-SAT on synthetic graphs of 100 to 20,000 nodes.

Two families of synthetic transformer-like graphs, each split into 8 stages under a
memory limit that binds (1.3x an even share of the whole model's memory):

- chain: embedding, layers (layer norm, attention, MLP, two residual adds), head tied to
         the embedding; consecutive nodes always linked, so the DP is exact.
- dag:   two such towers side by side, fed by one embedding and joined before the
         head, each layer's attention and MLP two parallel branches that meet at its add;
         the blocks do not form a chain, so CP-SAT runs (warm-started with the DP plan).

It also times a naive formulation on the 2,000-node chain: CP-SAT straight on the nodes
(no coarsening, no warm start) with a 60 s limit (wall clock and deterministic), against
the DP's optimum on the same nodes.

    python -m benchmarks.solver_scaling [--quick] [--time-limit SECONDS]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Any, Sequence

from partitioner.solve.coarsen import build_problem, coarsen, param_sizes
from partitioner.ir import BlockCost, Edge, GraphNode, NodeCost, PartitionProblem
from partitioner.solve.solve import objective, solve, solve_cpsat

from .common import save, table, update_docs

SIZES = [100, 500, 2000, 5000, 20000]
QUICK_SIZES = [100, 2000]
STAGES, MICROBATCHES, MAX_BLOCKS = 8, 8, 160
EMBED = "embed.weight"


# -- synthetic graphs ---------------------------------------------------------------------


class _Graph:
    """Appends GraphNodes with random costs; names are n0, n1, ..."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.nodes: list[GraphNode] = []

    def add(self, inputs: Sequence[str], module: str, scale: float, params: Sequence[str] = (),
            param_bytes: int = 0, **extra: Any) -> str:
        name = f"n{len(self.nodes)}"
        t = scale * self.rng.uniform(0.5, 1.5) * 1e-4
        cost = NodeCost(name, forward_s=t / 3, backward_s=2 * t / 3, flops=int(t * 1e14), param_bytes=param_bytes,
                        activation_bytes=self.rng.randint(1, 4) << 20, output_bytes=4 << 20)
        self.nodes.append(GraphNode(name, tuple(inputs), cost, module, tuple(params), **extra))
        return name


def transformer(nodes: int, branches: bool, seed: int = 0) -> list[GraphNode]:
    """A chain (branches=False) of about `nodes` nodes in layers of uneven width; or a
    DAG: two such towers side by side from one embedding, layers with parallel branches."""
    g = _Graph(seed)
    x = g.add([], "embed", 1.0, [EMBED], 64 << 20)
    towers = ["towers.a", "towers.b"] if branches else ["layers"]
    ends: list[str] = []
    for tower in towers:
        y, layer = x, 0
        while len(g.nodes) < (nodes - 4) * (len(ends) + 1) // len(towers):
            y = _layer(g, y, f"{tower}.{layer}", g.rng.choice([1.0, 2.0, 4.0]), branches)
            layer += 1
        ends.append(y)
    x = g.add(ends, "norm", 0.2)
    x = g.add([x], "head", 8.0, [EMBED], 64 << 20)
    g.add([x], "", 0.0, is_output=True)
    return g.nodes


def _layer(g: _Graph, x: str, path: str, width: float, branches: bool) -> str:
    h = g.add([x], f"{path}.ln_1", 0.2, [f"{path}.ln_1.weight"], 4 << 10)
    for part in ("q", "k", "v"):
        h = g.add([h] if part == "q" else [h, x], f"{path}.attn.{part}", width, [f"{path}.attn.{part}.weight"], 4 << 20)
    a = g.add([h], f"{path}.attn.out", width, [f"{path}.attn.out.weight"], 4 << 20)
    start = x if branches else g.add([x, a], path, 0.1)  # parallel: the MLP reads the layer input
    m = g.add([start], f"{path}.ln_2", 0.2, [f"{path}.ln_2.weight"], 4 << 10)
    m = g.add([m], f"{path}.mlp.fc", 2 * width, [f"{path}.mlp.fc.weight"], 16 << 20)
    m = g.add([m], f"{path}.mlp.act", 0.3)
    m = g.add([m], f"{path}.mlp.proj", 2 * width, [f"{path}.mlp.proj.weight"], 16 << 20)
    return g.add([start, m, a] if branches else [start, m], path, 0.1)


def problem_of(nodes: Sequence[GraphNode], blocks: list[BlockCost], edges: list[Edge]) -> PartitionProblem:
    """Eight stages, 1F1B, Adam, a 25 GB/s link, memory 1.3x an even share."""
    sizes = param_sizes(nodes)
    total = sum(sizes.values()) * 4 + sum(b.activation_bytes for b in blocks) * MICROBATCHES
    return build_problem(blocks, edges, STAGES, MICROBATCHES, param_bytes=sizes,
                         memory_limit_bytes=int(1.3 * total / STAGES),
                         comm_alpha_s=10e-6, comm_beta_s_per_byte=1 / 25e9)


def per_node(nodes: Sequence[GraphNode]) -> tuple[list[BlockCost], list[Edge]]:
    """One block per node: no coarsening at all (the naive formulation's input)."""
    index = {n.name: i for i, n in enumerate(nodes)}
    blocks = [BlockCost(n.name, (n.name,), n.cost.time_s, n.cost.param_bytes, n.cost.activation_bytes,
                        params=tuple(sorted(n.params))) for n in nodes]
    edges = sorted({Edge(index[i], index[n.name], i, nodes[index[i]].cost.output_bytes)
                    for n in nodes for i in n.inputs}, key=lambda e: (e.src, e.dst))
    return blocks, edges


# -- measurements ------------------------------------------------------------------------


def run_case(kind: str, size: int, time_limit: float) -> dict[str, Any]:
    nodes = transformer(size, branches=kind == "dag")
    start = time.perf_counter()
    blocks, edges = coarsen(nodes, MAX_BLOCKS)
    coarsen_ms = (time.perf_counter() - start) * 1e3
    problem = problem_of(nodes, blocks, edges)
    _, dp = solve(problem, time_limit_s=0)
    _, report = solve(problem, time_limit_s=time_limit)
    cpsat = report.method != "dp"
    return {"graph": kind, "nodes": len(nodes), "blocks": len(blocks), "edges": len(edges),
            "coarsen_ms": coarsen_ms, "dp_ms": dp.wall_s * 1e3,
            "cpsat_s": report.wall_s - dp.wall_s if cpsat else "-",
            "method": report.method, "status": report.status,
            "slowest_ms": report.objective_s * 1e3, "gap": report.gap}


def run_naive(size: int, time_limit: float) -> dict[str, Any]:
    """CP-SAT on the raw nodes of the chain, cold, against the DP's optimum there."""
    nodes = transformer(size, branches=False)
    problem = problem_of(nodes, *per_node(nodes))
    start = time.perf_counter()
    _, dp = solve(problem, time_limit_s=0)
    dp_s = time.perf_counter() - start
    start = time.perf_counter()
    cp = solve_cpsat(problem, time_limit, wall_limit_s=time_limit)
    wall = time.perf_counter() - start
    found = objective(problem, cp.assignment) if cp.assignment is not None else None  # None: no plan found
    return {"nodes": len(nodes), "blocks": problem.num_blocks, "dp_s": dp_s, "dp_slowest_ms": dp.objective_s * 1e3,
            "cpsat_s": wall, "cpsat_status": cp.status, "cpsat_slowest_ms": found * 1e3 if found else "-",
            "cpsat_bound_ms": cp.lower_bound_s * 1e3, "cpsat_vs_optimum": found / dp.objective_s if found else "-"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES} only, shorter limits")
    parser.add_argument("--time-limit", type=float, default=None, help="CP-SAT deterministic time (default 10, quick 2)")
    ns = parser.parse_args(argv)
    limit = ns.time_limit if ns.time_limit is not None else (2.0 if ns.quick else 10.0)
    rows = []
    for size in QUICK_SIZES if ns.quick else SIZES:
        for kind in ("chain", "dag"):
            rows.append(run_case(kind, size, limit))
            print(f"{kind} {size}: {rows[-1]}", file=sys.stderr, flush=True)
    naive = run_naive(2000, 10.0 if ns.quick else 60.0)
    cols = ["graph", "nodes", "blocks", "edges", "coarsen_ms", "dp_ms", "cpsat_s", "method", "status", "slowest_ms", "gap"]
    naive_cols = ["nodes", "blocks", "dp_s", "dp_slowest_ms", "cpsat_s", "cpsat_status", "cpsat_slowest_ms",
                  "cpsat_bound_ms", "cpsat_vs_optimum"]
    text = table(rows, cols)
    naive_text = table([naive], naive_cols)
    print(text + "\n\nNaive CP-SAT on the raw 2,000-node chain (no coarsening, no warm start):\n\n" + naive_text)
    save("solver_scaling", rows, naive=naive, stages=STAGES, time_limit_s=limit)
    update_docs("solver_scaling", text + "\n\nNaive CP-SAT on the raw 2,000-node chain:\n\n" + naive_text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
