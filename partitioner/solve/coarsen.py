"""Coarsen the compute nodes of a graph into blocks: the solver's unit of assignment.

A block is a contiguous run of the nodes' topological order, so the graph of blocks
stays acyclic with blocks numbered in a topological order.  In four steps:

    1. order:  the output node, and anything that reads it, go last, so the last block
               holds the graph's output (the solver puts it in the last stage); the
               nodes that touch one mutated buffer are brought together.
    2. atoms:  the runs no block boundary may split: a non-tensor value (the tuple of
               torch.split) stays with all its consumers, the nodes of a mutated buffer
               stay together ([Note: a mutated buffer lives on one stage] in
               trace/buffers.py), and the output tail stays whole.
    3. fuse:   an atom of negligible time joins a neighbour (of its own module if it
               can, else across the boundary that cuts more bytes).
    4. merge:  the modules of the deepest depth that gives at most `max_blocks` become
               the blocks (a transformer's `h.0`, `h.1`, ...); what room is left splits
               the heaviest of them into pieces of about equal time at their submodules.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..ir import DEFAULT_SCHEDULE, BlockCost, Edge, GraphNode, PartitionProblem
from runtime.recompute import parse_policy

__all__ = ["build_problem", "coarsen", "param_sizes"]


@dataclass(frozen=True)
class _Run:
    """Nodes [start, end) of the order, of module path `path`."""

    start: int
    end: int
    path: tuple[str, ...]
    time_s: float


def coarsen(nodes: Sequence[GraphNode], max_blocks: int, *, param_bytes: Mapping[str, int] | None = None,
            cheap_fraction: float = 0.05) -> tuple[list[BlockCost], list[Edge]]:
    """Blocks (in topological order) and the values that cross between them.

    At most `max_blocks` blocks; a run whose time is under `cheap_fraction` of an even
    share (total / max_blocks) is fused into a neighbour.  `param_bytes` gives each parameter's size; without it the
    sizes are inferred from the nodes' `cost.param_bytes` (see `param_sizes`).
    """
    if max_blocks < 1:
        raise ValueError(f"max_blocks must be at least 1, got {max_blocks}")
    order = _order(nodes)
    cheap_s = cheap_fraction * sum(n.cost.time_s for n in order) / max_blocks
    runs = _merge_levels(_Fuser(_atoms(order), _crossing_bytes(order), cheap_s).run(), max_blocks)
    return _blocks(order, runs, param_sizes(order, param_bytes)), _edges(order, runs)


def build_problem(blocks: Sequence[BlockCost], edges: Sequence[Edge], stages: int, microbatches: int, *,
                  schedule: str = DEFAULT_SCHEDULE, memory_limit_bytes: int | None = None, optimizer_factor: float = 2,
                  comm_alpha_s: float = 0.0, comm_beta_s_per_byte: float = 0.0,
                  param_bytes: Mapping[str, int] | None = None, virtual_stages: int = 1,
                  recompute: bool | str | None = False) -> PartitionProblem:
    """The `PartitionProblem` of coarsened blocks; `param_bytes` lets a stage that holds
    several blocks reading one (tied) parameter hold it once.  With `recompute` (True or
    "full"), a block's time includes its forward run again in the backward; "selective",
    the forward of the ops it does not keep, and it keeps its matmuls' outputs."""
    used = {name for b in blocks for name in b.params}
    policy = parse_policy(recompute)
    again = {None: lambda b: 0.0, "full": lambda b: b.forward_s, "selective": lambda b: b.recomputed_s}[policy]
    return PartitionProblem(
        block_time_s=tuple(b.time_s + again(b) for b in blocks),
        block_param_bytes=tuple(b.param_bytes for b in blocks),
        block_activation_bytes=tuple(max(0, b.activation_bytes - b.kept_bytes) if policy == "selective"
                                     else b.activation_bytes for b in blocks),
        edges=tuple(edges),
        stages=stages,
        microbatches=microbatches,
        schedule=schedule,
        memory_limit_bytes=memory_limit_bytes,
        optimizer_factor=optimizer_factor,
        comm_alpha_s=comm_alpha_s,
        comm_beta_s_per_byte=comm_beta_s_per_byte,
        block_names=tuple(b.name for b in blocks),
        block_params=tuple(b.params for b in blocks),
        param_bytes_by_name=tuple(sorted((k, v) for k, v in (param_bytes or {}).items() if k in used)),
        virtual_stages=virtual_stages,
        recompute=policy is not None,
        block_kept_bytes=tuple(b.kept_bytes for b in blocks) if policy == "selective" else (),
        block_computes=tuple(b.computes for b in blocks),
        block_seed_bytes=tuple(b.seed_bytes for b in blocks),
    )


def param_sizes(nodes: Sequence[GraphNode], known: Mapping[str, int] | None = None) -> dict[str, int]:
    """Each parameter's bytes: `known`, else solved from the nodes' `cost.param_bytes`
    (the sum of the parameters a node reads) one unknown at a time, else split evenly."""
    sizes = dict(known or {})

    def unknown(node: GraphNode) -> list[str]:
        return sorted({p for p in node.params if p not in sizes})

    def rest(node: GraphNode) -> int:
        return max(0, node.cost.param_bytes - sum(sizes[p] for p in set(node.params) if p in sizes))

    progress = True
    while progress:
        progress = False
        for node in nodes:
            if len(missing := unknown(node)) == 1:
                sizes[missing[0]], progress = rest(node), True
    for node in nodes:
        missing, left = unknown(node), rest(node)
        for i, name in enumerate(missing):
            sizes[name] = left // len(missing) + (left % len(missing) if i == len(missing) - 1 else 0)
    return sizes


# -- 1. order and 2. atoms ---------------------------------------------------------------


def _order(nodes: Sequence[GraphNode]) -> list[GraphNode]:
    """The nodes with the output and its readers moved, in order, to the end."""
    seen: set[str] = set()
    tail: set[str] = set()
    for node in nodes:
        missing = [i for i in node.inputs if i not in seen]
        if node.name in seen or missing:
            raise ValueError(f"coarsen: node {node.name!r} is repeated or reads {missing} before they are "
                             "computed; nodes must be unique and in topological order")
        seen.add(node.name)
        if node.is_output or any(i in tail for i in node.inputs):
            tail.add(node.name)
    order = [n for n in nodes if n.name not in tail] + [n for n in nodes if n.name in tail]
    for buffer in sorted({b for n in order for b in n.mutated}):
        order = _gather(order, {n.name for n in order if buffer in n.mutated})
    return order


def _gather(order: list[GraphNode], members: set[str]) -> list[GraphNode]:
    """`order` with the span from the first member to the last made as short as any
    topological order makes it: of the nodes between, those that no member feeds move
    before the members, those that feed no member after them; only those both fed by a
    member and feeding one stay among them."""
    at = [i for i, n in enumerate(order) if n.name in members]
    span = order[at[0]:at[-1] + 1]
    fed, feeding = set(members), set(members)
    for node in span:
        if fed.intersection(node.inputs):
            fed.add(node.name)
    for node in reversed(span):
        if node.name in feeding:
            feeding.update(node.inputs)
    before = [n for n in span if n.name not in fed]
    among = [n for n in span if n.name in fed and n.name in feeding]
    after = [n for n in span if n.name in fed and n.name not in feeding]
    return order[:at[0]] + before + among + after + order[at[-1] + 1:]


def _atoms(order: Sequence[GraphNode]) -> list[_Run]:
    """Maximal runs that no block boundary may split."""
    pos = {n.name: i for i, n in enumerate(order)}
    last_reader = list(range(len(order)))
    for i, node in enumerate(order):
        for name in node.inputs:
            last_reader[pos[name]] = max(last_reader[pos[name]], i)
    last_toucher: dict[str, int] = {}  # mutated buffer -> the last position of a node that touches it
    for i, node in enumerate(order):
        last_toucher.update((b, i) for b in node.mutated)
    reach = -1  # no boundary before position `reach` (inclusive)
    starts = []
    tail = next((i for i, n in enumerate(order) if n.is_output), len(order))
    for i, node in enumerate(order):
        if reach < i <= tail:
            starts.append(i)
        if not node.tensor_output:
            reach = max(reach, last_reader[i])
        reach = max([reach] + [last_toucher[b] for b in node.mutated])
    bounds = starts + [len(order)]
    return [_run(order, a, b) for a, b in zip(bounds, bounds[1:])]


def _run(order: Sequence[GraphNode], start: int, end: int) -> _Run:
    paths = [tuple(n.module.split(".")) if n.module else () for n in order[start:end]]
    common = paths[0]
    for p in paths[1:]:
        common = common[:_shared(common, p)]
    return _Run(start, end, common, sum(n.cost.time_s for n in order[start:end]))


# -- 3. fuse and 4. merge -------------------------------------------------------------------


def _shared(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    """How many leading module names `a` and `b` share."""
    k, most = 0, min(len(a), len(b))
    while k < most and a[k] == b[k]:
        k += 1
    return k


class _Fuser:
    """Neighbouring runs, each cheap one (under `cheap_s`) fused into a neighbour.

    Pairs go through a heap, the one with the deepest shared module first, then the one
    whose boundary cuts more bytes; the fused run keeps its dearer member's module.
    """

    def __init__(self, atoms: Sequence[_Run], crossing: Sequence[int], cheap_s: float) -> None:
        self.runs: list[_Run | None] = list(atoms)
        self.next = list(range(1, len(atoms))) + [-1]
        self.prev = list(range(-1, len(atoms) - 1))
        self.crossing, self.cheap_s = crossing, cheap_s
        self.version = [0] * len(atoms)
        self.heap = [e for e in map(self._entry, range(len(atoms) - 1)) if e is not None]
        heapq.heapify(self.heap)

    def _entry(self, g: int) -> tuple[int, float, int, int] | None:
        """(-shared depth, -bytes cut, g, version) of the pair (g, next), if one is cheap."""
        a, b = self.runs[g], self.runs[self.next[g]]
        assert a is not None and b is not None
        if min(a.time_s, b.time_s) >= self.cheap_s:
            return None
        return (-_shared(a.path, b.path), -float(self.crossing[b.start]), g, self.version[g])

    def run(self) -> list[_Run]:
        while self.heap:
            _, _, g, version = heapq.heappop(self.heap)
            if version == self.version[g] and self.runs[g] is not None and self.next[g] >= 0:
                self._fuse(g)
        return [r for r in self.runs if r is not None]

    def _fuse(self, g: int) -> None:
        h = self.next[g]
        a, b = self.runs[g], self.runs[h]
        assert a is not None and b is not None
        self.runs[g] = _Run(a.start, b.end, b.path if b.time_s > a.time_s else a.path, a.time_s + b.time_s)
        self.runs[h], self.next[g] = None, self.next[h]
        if self.next[g] >= 0:
            self.prev[self.next[g]] = g
        for pair in (self.prev[g], g):
            if pair >= 0 and self.next[pair] >= 0:
                self.version[pair] += 1
                entry = self._entry(pair)
                if entry is not None:
                    heapq.heappush(self.heap, entry)


def _merge_levels(runs: list[_Run], max_blocks: int) -> list[_Run]:
    """Merge each module into one run, innermost first, while that leaves more than
    `max_blocks`; then split the modules of the last depth back, heaviest first."""
    for depth in range(max((len(r.path) for r in runs), default=0), -1, -1):
        if len(runs) <= max_blocks:
            return runs
        groups = _by_module(runs, depth)
        if len(groups) <= max_blocks:
            return _split_heaviest(groups, max_blocks)
        runs = [_join(g) for g in groups]
    return runs


def _by_module(runs: Sequence[_Run], depth: int) -> list[list[_Run]]:
    """Consecutive runs whose module paths agree to `depth` names."""
    groups: list[list[_Run]] = []
    for r in runs:
        if groups and groups[-1][0].path[:depth] == r.path[:depth]:
            groups[-1].append(r)
        else:
            groups.append([r])
    return groups


def _join(runs: Sequence[_Run]) -> _Run:
    path = runs[0].path
    for r in runs[1:]:
        path = path[:_shared(path, r.path)]
    return _Run(runs[0].start, runs[-1].end, path, sum(r.time_s for r in runs))


def _split_heaviest(groups: Sequence[Sequence[_Run]], max_blocks: int) -> list[_Run]:
    """Each group into pieces of about equal time, one more piece at a time to the group
    whose largest piece is largest, until there are `max_blocks`."""
    prefixes = [list(itertools.accumulate((r.time_s for r in g), initial=0.0)) for g in groups]
    pieces = [1] * len(groups)
    heap = [(-p[-1], i) for i, p in enumerate(prefixes)]
    heapq.heapify(heap)
    spare = max_blocks - len(groups)
    while spare > 0 and heap:
        _, i = heapq.heappop(heap)
        if pieces[i] < len(groups[i]):
            pieces[i] += 1
            spare -= 1
            cuts, prefix = _cuts(prefixes[i], pieces[i]), prefixes[i]
            heapq.heappush(heap, (-max(prefix[b] - prefix[a] for a, b in zip(cuts, cuts[1:])), i))
    return [_join(g[a:b]) for g, p, k in zip(groups, prefixes, pieces)
            for a, b in itertools.pairwise(_cuts(p, k))]


def _cuts(prefix: Sequence[float], parts: int) -> list[int]:
    """Where to cut runs with these prefix sums of time into `parts` pieces of about
    equal time: 0, the cuts nearest to each equal share, len."""
    n, cuts = len(prefix) - 1, [0]
    for k in range(1, parts):
        target = prefix[-1] * k / parts
        lo, hi = cuts[-1] + 1, n - (parts - k)
        c = min(max(bisect.bisect_left(prefix, target), lo), hi)
        if c > lo and target - prefix[c - 1] <= prefix[c] - target:
            c -= 1
        cuts.append(c)
    return cuts + [n]


def _crossing_bytes(order: Sequence[GraphNode]) -> list[int]:
    """Bytes of the values that a boundary before position c would cut, for each c."""
    pos = {n.name: i for i, n in enumerate(order)}
    last = {}
    for i, node in enumerate(order):
        for name in node.inputs:
            last[pos[name]] = i
    diff = [0] * (len(order) + 2)
    for p, q in last.items():
        diff[p + 1] += order[p].cost.output_bytes
        diff[q + 1] -= order[p].cost.output_bytes
    out, acc = [], 0
    for d in diff:
        acc += d
        out.append(acc)
    return out


def _blocks(order: Sequence[GraphNode], runs: Sequence[_Run], sizes: Mapping[str, int]) -> list[BlockCost]:
    blocks: list[BlockCost] = []
    taken: set[str] = set()
    spans = _module_spans(order)
    for run in runs:
        nodes = order[run.start:run.end]
        name = base = _label(run, nodes, spans)
        while name in taken:
            name = f"{base}#{sum(t.split('#')[0] == base for t in taken) + 1}"
        taken.add(name)
        params = tuple(sorted({p for n in nodes for p in n.params}))
        blocks.append(BlockCost(
            name=name, nodes=tuple(n.name for n in nodes), time_s=sum(n.cost.time_s for n in nodes),
            param_bytes=sum(sizes.get(p, 0) for p in params),
            activation_bytes=sum(n.cost.activation_bytes for n in nodes),
            flops=sum(n.cost.flops for n in nodes), params=params,
            forward_s=sum(n.cost.forward_s for n in nodes), computes=any(n.computes for n in nodes),
            kept_bytes=sum(n.cost.output_bytes for n in nodes if n.saved),
            recomputed_s=sum(n.cost.forward_s for n in nodes if not n.saved),
            seed_bytes=sum(n.cost.output_bytes for n in nodes if n.cost.param_bytes)))
    return blocks


def _module_spans(order: Sequence[GraphNode]) -> dict[tuple[str, ...], tuple[int, int]]:
    """First and last position of the nodes inside each module."""
    spans: dict[tuple[str, ...], tuple[int, int]] = {}
    for i, n in enumerate(order):
        parts = tuple(n.module.split(".")) if n.module else ()
        for d in range(1, len(parts) + 1):
            spans[parts[:d]] = (spans.get(parts[:d], (i, i))[0], i)
    return spans


def _label(run: _Run, nodes: Sequence[GraphNode], spans: Mapping[tuple[str, ...], tuple[int, int]]) -> str:
    """The module the block holds whole, else its first and last submodules ('h.3..h.5')."""
    first, last = spans.get(run.path, (-1, -1))
    if run.path and run.start <= first and last < run.end:
        return ".".join(run.path)
    depth = len(run.path) + 1

    def part(n: GraphNode) -> str:
        return ".".join(n.module.split(".")[:depth]) if n.module else n.name

    a, b = part(nodes[0]), part(nodes[-1])
    return a if a == b else f"{a}..{b}"


def _edges(order: Sequence[GraphNode], runs: Sequence[_Run]) -> list[Edge]:
    block = {}
    for b, run in enumerate(runs):
        for node in order[run.start:run.end]:
            block[node.name] = b
    by_name = {n.name: n for n in order}
    pos = {n.name: i for i, n in enumerate(order)}
    found: dict[tuple[int, int, str], Edge] = {}
    for node in order:
        for name in node.inputs:
            src, dst = block[name], block[node.name]
            if src != dst:
                found.setdefault((src, dst, name), Edge(src, dst, name, by_name[name].cost.output_bytes))
    return sorted(found.values(), key=lambda e: (e.src, e.dst, pos[e.value]))
