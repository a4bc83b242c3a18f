"""The compile driver: model file -> trace -> cost -> solve -> emit.

Each phase is one function call on plain data; this module only sequences them, checks
the options, and reports progress on stderr.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.fx
import torch.utils._pytree as pytree

from . import cache, model_file
from .cost import CALIBRATION_MIN_S, PROFILE_VERSION, CalibrationError, annotate, calibrate_stages, compute_nodes, storage_key
from .errors import PlanError
from .hardware import RANK_THREADS, Hardware, load_hardware, rank_threads
from .ir import NodeCost, PartitionProblem, Plan, SolverReport, StagePlan
from .options import (CompileOptions, batch_size, check, default_microbatches, fixed_tp, rows_per_microbatch,
                      split_batch)
from .passes import get_attr, propagate, specialize
from .predict import predict, rounded
from .problem import Coarse, coarse_graph, make_plan, pose
from .solve import solve
from .tp import Sharded, shard
from .trace import Traced, by_input_key, copy_traced, trace

from runtime.affinity import binding_enabled, bound_as_local_rank, cpu_share

__all__ = ["CompileOptions", "Compiled", "Prepared", "Source", "assign_nodes", "compile_model", "finish", "load_source",
           "prepare", "split_batch"]


@dataclass
class Compiled:
    """What a compile produced, for the CLI and for tests."""

    manifest: dict[str, Any]
    plan: Plan
    traced: Traced
    costs: dict[str, NodeCost]
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class Prepared:
    """A model traced, costed and posed as a partition problem: everything before solving."""

    opts: CompileOptions
    mf: model_file.ModelFile
    model: torch.nn.Module
    traced: Traced
    costs: dict[str, NodeCost]
    hardware: Hardware
    problem: PartitionProblem
    blocks: list[Any]
    batch: int
    rows: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    pp: int
    virtual: int
    microbatches: int
    timings: dict[str, float] = field(default_factory=dict)
    #: the graph before tensor parallelism and its costs (what --devices re-shards)
    whole: tuple[Traced, dict[str, NodeCost]] | None = None
    sharded: Sharded | None = None
    coarse: Coarse | None = None  # the blocks `problem` was posed from
    values: dict[torch.fx.Node, Any] | None = None  # one microbatch's value of every node (tp = 1)
    say: Callable[[str], None] = field(default=lambda _m: None, repr=False)  # progress and warnings


@dataclass
class Source:
    """A model file loaded, its model built and its example batch: what every microbatch
    shape of one compile (or `--devices` search) shares."""

    mf: model_file.ModelFile
    model: torch.nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    batch: int
    #: the model's fx trace before specialisation, which serves any microbatch shape
    generic: Traced | None = None


def load_source(opts: CompileOptions, say: Callable[[str], None] = lambda _m: None) -> Source:
    """Load the model file, build the model (on the meta device when `_build` says so)
    and take its example batch (moved to the meta device with a meta model)."""
    mf = model_file.load(opts.model, opts.entry)
    model = _build(mf, opts, say)
    args, kwargs = mf.example_inputs()
    if _is_meta(model):
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
    return Source(mf, model, args, kwargs, batch_size(mf, args, kwargs))


def compile_model(opts: CompileOptions, log: Callable[[str], None] | None = None) -> Compiled:
    """Compile `opts.model` into the package `opts.out`."""
    say = log or (lambda msg: None if opts.quiet else print(msg, file=sys.stderr))
    if opts.devices is not None and (opts.stages is None or opts.tp is None or opts.microbatches is None):
        from .search import search

        return search(opts, say)
    opts = fixed_tp(opts)
    prepared = prepare(opts, say)
    start = time.perf_counter()
    say(f"solving: {len(compute_nodes(prepared.traced.gm))} nodes in {prepared.problem.num_blocks} blocks "
        f"into {prepared.problem.stages} stages")
    assignment, report = solve(prepared.problem, time_limit_s=opts.time_limit)
    prepared.timings["solve"] = time.perf_counter() - start
    compiled = finish(prepared, assignment, report)
    say(f"wrote {opts.out}: {prepared.problem.stages} stages; {report.method}, gap {report.gap * 100:.1f}%, "
        f"solver {report.wall_s:.2f} s, total {sum(compiled.timings.values()):.2f} s")
    return compiled


def prepare(opts: CompileOptions, say: Callable[[str], None] = lambda _m: None, source: Source | None = None) -> Prepared:
    """Load, trace, specialise and cost the model; split it for tensor parallelism; pose
    the partition problem.  `source`: the model file already loaded (`load_source`)."""
    opts = fixed_tp(opts)
    timings: dict[str, float] = {}
    clock = time.perf_counter()

    def phase(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        timings[name] = now - clock
        clock = now

    pp, virtual, microbatches = check(opts)
    # 1. The model file and one microbatch of its example batch.
    src = source or load_source(opts, say)
    mf, model, args, kwargs, batch = src.mf, src.model, src.args, src.kwargs, src.batch
    microbatches = microbatches or default_microbatches(batch, pp, opts)
    rows = rows_per_microbatch(batch, microbatches, opts.dp)
    margs, mkwargs = split_batch(args, kwargs, mf.batch_dims, rows)
    phase("load")
    # 2. Trace and specialise to the microbatch shape.
    traced = _trace(src, margs, mkwargs, opts, rows, say)
    by_key = by_input_key(margs, mkwargs)
    values = propagate(traced.gm, [by_key[key] for _name, key in traced.input_keys], opts.model)
    specialize(traced.gm, values)
    phase("trace")
    # 3. Cost every node, measured (cached) or analytic.
    hardware = load_hardware(opts.hardware)
    with rank_threads():  # measured as a rank will compute
        costs = _costs(traced.gm, values, hardware, opts, say)
    phase("cost")
    # 4. Tensor parallelism: the split per node, and the graph one rank runs.
    whole = (traced, costs)
    traced, costs, sharded = apply_tp(traced, costs, opts.tp or 1, hardware, opts, say)
    phase("tp")
    # 5. Coarsen into blocks and pose the problem.
    coarse = coarse_graph(traced, costs, sharded)
    problem = pose(coarse, pp * virtual, microbatches, hardware, opts)
    phase("coarsen")
    return Prepared(opts, mf, model, traced, costs, hardware, problem, coarse.blocks, batch, rows, args, kwargs,
                    pp, virtual, microbatches, timings, whole, sharded, coarse, values if sharded is None else None, say)


def _trace(src: Source, margs: tuple[Any, ...], mkwargs: dict[str, Any], opts: CompileOptions, rows: int,
           say: Callable[[str], None]) -> Traced:
    """The model's graph for this microbatch, to specialise: a copy of its fx trace when
    `src` has one (kept from an earlier shape), else a new trace."""
    if src.generic is not None:
        return copy_traced(src.generic)
    say(f"tracing {opts.model} ({type(src.model).__name__}, microbatch of {rows} rows)")
    traced = trace(src.model, margs, mkwargs, opts.tracer, opts.model)
    if traced.tracer == "fx":
        src.generic = copy_traced(traced)
    return traced


def apply_tp(traced: Traced, costs: dict[str, NodeCost], tp: int, hardware: Hardware, opts: CompileOptions,
             say: Callable[[str], None] = lambda _m: None) -> tuple[Traced, dict[str, NodeCost], Sharded | None]:
    """The graph and costs of one tensor-parallel rank (unchanged for tp = 1)."""
    if tp == 1:
        return traced, costs, None
    sharded = shard(traced.gm, costs, tp, hardware, time_limit_s=min(opts.time_limit, 10.0))
    report = sharded.report
    saved = f", {(1 - report.objective_s / report.replicated_s) * 100:.0f}% below replicated" if report else ""
    say(f"tensor parallel x{tp}: {len(sharded.rules)} nodes split, {len(sharded.params)} weights sharded, "
        f"collectives {sharded.collectives or 'none'}{saved}")
    if not sharded.rules:
        say(f"warning: --tp {tp} splits nothing (no width divides by {tp}, or on {hardware.name} every collective "
            f"costs more than the split saves): the {tp} ranks of each group repeat the same work; use --tp 1.")
    return dataclasses.replace(traced, gm=sharded.gm, output_leaves=_local_leaves(traced, sharded.gm)), \
        sharded.costs, sharded


def _local_leaves(traced: Traced, local: torch.fx.GraphModule) -> list[Any]:
    """The output leaves as nodes of the rewritten graph (the output reads gathered values)."""
    def reads(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
        out = next(n for n in gm.graph.nodes if n.op == "output")
        found: list[torch.fx.Node] = []
        torch.fx.node.map_arg(out.args, found.append)
        return found

    mapping = dict(zip(reads(traced.gm), reads(local)))
    return [mapping.get(leaf, leaf) if isinstance(leaf, torch.fx.Node) else leaf for leaf in traced.output_leaves]


def finish(prepared: Prepared, assignment: tuple[int, ...], report: SolverReport | None = None,
           extra: dict[str, Any] | None = None) -> Compiled:
    """Turn a stage per block into a Plan and emit the package (`extra` joins `predicted`)."""
    p = prepared
    if report is not None:
        report = dataclasses.replace(report, nodes=len(compute_nodes(p.traced.gm)), blocks=p.problem.num_blocks)
    return _emit(p, make_plan(p.problem, p.blocks, assignment, report, p.opts, p.pp, p.virtual, p.microbatches), extra)


def _emit(p: Prepared, plan: Plan, extra: dict[str, Any] | None = None) -> Compiled:
    from codegen import emit

    start = time.perf_counter()
    costs = _stage_costs(p, plan)
    info = _package_info(p.opts, p.mf, p.model, p.traced, p.batch, p.args, p.kwargs, p.rows, plan, costs, p.hardware,
                         p.sharded, model_flops(p))
    info.predicted.update(rounded(extra or {}))
    manifest = emit(p.opts.out, p.traced.gm, plan, info)
    p.timings["emit"] = time.perf_counter() - start
    return Compiled(manifest, plan, p.traced, costs, dict(p.timings))


def _stage_costs(p: Prepared, plan: Plan) -> dict[str, NodeCost]:
    """The node costs the prediction uses: where costs are measured and stages wait for
    messages on the cores they compute on (the cpu profile), calibrated stage by stage as
    a rank runs them (`cost.calibrate_stages`: after a message's wait, on a rank's thread
    and cores, every rank beside the others when each has cores of its own), cached per
    plan so that compiles on one machine stay byte-identical; else the costs as they are."""
    wait = p.hardware.idle_before_compute_s
    if p.opts.analytic or not wait or p.values is None or plan.num_stages < 2 or plan.recompute:
        return p.costs
    stage_of = plan.stage_of()
    ranks = plan.pp * plan.tp * plan.dp
    side_by_side = _rank_cores(plan)
    key = "stages-" + hashlib.sha256(json.dumps(
        [PROFILE_VERSION, p.traced.gm.code, sorted(stage_of.items()), wait, p.opts.repeats, CALIBRATION_MIN_S, torch.__version__,
         RANK_THREADS, binding_enabled() and ranks, [(stages, sorted(cores)) for stages, cores in side_by_side],
         sorted((n, asdict(c)) for n, c in p.costs.items())]
    ).encode()).hexdigest()[:32]
    cached = None if p.opts.reprofile else cache.get(key)
    if isinstance(cached, dict) and set(cached) == set(p.costs):
        return {name: NodeCost(**c) for name, c in cached.items()}
    p.say(f"calibrating {plan.num_stages} stages as the ranks run them"
          + (f", {len(side_by_side)} ranks side by side" if side_by_side else ""))
    failed = False
    with rank_threads():  # on a rank's threads and cores (runtime/affinity.py)
        try:
            if side_by_side:
                costs = calibrate_stages(p.traced.gm, p.values, p.costs, stage_of, p.opts.repeats, wait, side_by_side)
        except CalibrationError as e:
            failed = True
            p.say(f"warning: timing the stages side by side failed ({e}); timing them one at a time")
        if failed or not side_by_side:
            with bound_as_local_rank(0, ranks):
                costs = calibrate_stages(p.traced.gm, p.values, p.costs, stage_of, p.opts.repeats, wait)
    if not failed:  # a fallback is not cached: the next compile tries side by side again
        cache.put(key, {name: asdict(c) for name, c in costs.items()})
    return costs


def _rank_cores(plan: Plan) -> list[tuple[list[int], set[int]]]:
    """Each rank's stages and the cores the runtime binds it to, when every rank gets
    cores of its own on this machine (`runtime.affinity.cpu_share`); else none.  Rank r
    holds the stages at position r // tp % pp (runtime/groups.py)."""
    ranks = plan.pp * plan.tp * plan.dp
    if not binding_enabled() or ranks < 2 or not hasattr(os, "sched_getaffinity"):
        return []
    allowed = os.sched_getaffinity(0)
    shares = [cpu_share(allowed, r, ranks) for r in range(ranks)]
    if any(share is None for share in shares):
        return []
    count = len(plan.stages)
    return [([s for s in range(count) if s % plan.pp == r // plan.tp % plan.pp], share)
            for r, share in enumerate(shares) if share is not None]


def assign_nodes(prepared: Prepared, stage_of: dict[str, int]) -> Compiled:
    """Emit the package for a given stage per compute node (baselines, experiments).

    Predicted stage times are the sums of the nodes' compute times (no traffic).
    """
    p = prepared
    order = [n.name for n in compute_nodes(p.traced.gm)]
    missing = [n for n in order if n not in stage_of]
    if missing:
        raise PlanError(f"assign_nodes: no stage for {len(missing)} nodes, e.g. {missing[:3]}")
    stages = []
    count = max(stage_of.values()) + 1
    for k in range(count):
        nodes = tuple(n for n in order if stage_of[n] == k)
        t = sum(p.costs[n].time_s for n in nodes)
        stages.append(StagePlan(index=k, nodes=nodes, time_s=t, compute_s=t))
    plan = Plan(stages=tuple(stages), schedule=p.opts.schedule, microbatches=p.microbatches,
                pp=count // p.virtual, tp=p.opts.tp or 1, dp=p.opts.dp, virtual_stages=p.virtual)
    return _emit(p, plan)


def _build(mf: model_file.ModelFile, opts: CompileOptions, say: Callable[[str], None]) -> torch.nn.Module:
    """The model, on the meta device when asked or when --analytic meets a model too big
    to build here (over a quarter of this machine's memory)."""
    if opts.meta is False or not (opts.analytic or opts.meta):
        return mf.build(opts.seed)
    with torch.device("meta"):
        probe = mf.build(opts.seed)
    size = sum(t.numel() * t.element_size() for t in probe.state_dict().values())
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if opts.meta or size > ram // 4:
        say(f"building on the meta device ({size / 2**30:.1f} GiB of weights): nothing is executed")
        return probe
    return mf.build(opts.seed)


def _is_meta(model: torch.nn.Module) -> bool:
    return any(t.is_meta for t in model.state_dict().values())


# -- cost --------------------------------------------------------------------------------


def _costs(gm: torch.fx.GraphModule, values: dict[torch.fx.Node, Any], hardware: Hardware,
           opts: CompileOptions, say: Callable[[str], None]) -> dict[str, NodeCost]:
    measure = not opts.analytic
    wait = hardware.idle_before_compute_s
    key = "profile-" + hashlib.sha256(
        json.dumps([PROFILE_VERSION, gm.code, [str(n.meta.get("tensor_meta")) for n in gm.graph.nodes],
                    hardware.name, measure, opts.repeats, torch.__version__, RANK_THREADS,
                    wait]).encode()
    ).hexdigest()[:32]
    cached = None if (opts.reprofile or not measure) else cache.get(key)
    nodes = compute_nodes(gm)
    if cached is not None and set(cached) == {n.name for n in nodes}:
        costs = {name: NodeCost(**c) for name, c in cached.items()}
        for n in nodes:
            n.meta["cost"] = costs[n.name]
        say(f"costs: {len(costs)} nodes from the profile cache (--reprofile to measure again)")
        return costs
    say(f"costs: {'profiling' if measure else 'estimating'} {len(nodes)} nodes on {hardware.name}")
    costs = annotate(gm, values, hardware, measure, opts.repeats, _progress(opts, len(nodes)), wait)
    if measure:
        cache.put(key, {name: asdict(c) for name, c in costs.items()})
    return costs


def _progress(opts: CompileOptions, total: int) -> Callable[[Iterable[torch.fx.Node]], Iterable[torch.fx.Node]]:
    if opts.quiet or not sys.stderr.isatty():
        return iter
    from tqdm import tqdm

    return lambda items: tqdm(items, total=total, desc="profiling", unit="node", leave=False)


# -- flops and the package ---------------------------------------------------------------


def model_flops(p: Prepared) -> int:
    """Forward FLOPs of one microbatch of the whole model (before any tensor split)."""
    costs = p.whole[1] if p.whole is not None else p.costs
    return sum(c.flops for c in costs.values())


def _package_info(opts: CompileOptions, mf: model_file.ModelFile, model: torch.nn.Module, traced: Traced,
                  batch: int, args: tuple[Any, ...], kwargs: dict[str, Any], rows: int, plan: Plan,
                  costs: dict[str, NodeCost], hardware: Hardware, sharded: Sharded | None, flops: int) -> Any:
    from codegen import PackageInfo

    gm = traced.gm
    by_key = by_input_key(args, kwargs)
    inputs = []
    for node in (n for n in gm.graph.nodes if n.op == "placeholder"):
        key = dict(traced.input_keys)[node.name]
        value = by_key[key]
        meta = node.meta.get("tensor_meta")
        inputs.append({
            "name": node.name, "key": key, "batch_dim": mf.batch_dims.get(key, 0),
            "shape": [int(d) for d in meta.shape] if meta is not None else None,
            "dtype": str(value.dtype).replace("torch.", "") if isinstance(value, torch.Tensor) else None,
        })
    graph_tensors = {str(n.target): get_attr(gm, str(n.target)) for n in gm.graph.nodes if n.op == "get_attr"}
    canonical = {storage_key(t): name for name, t in graph_tensors.items() if isinstance(t, torch.Tensor)}
    original = model.state_dict(keep_vars=True)
    aliases = {k: canonical[storage_key(t)] for k, t in original.items()
               if storage_key(t) in canonical and canonical[storage_key(t)] != k}
    unused = {k: t for k, t in original.items() if storage_key(t) not in canonical and k not in aliases}
    predicted = predict(gm, plan, costs, hardware, cost_source="analytic" if opts.analytic else "measured",
                        model_flops=flops)
    options = {"stages": plan.pp, "tp": plan.tp, "microbatches": plan.microbatches, "schedule": plan.schedule,
               "memory": opts.memory, "hardware": hardware.name, "analytic": opts.analytic,
               "optimizer": opts.optimizer} | ({"recompute": True} if plan.recompute else {})
    return PackageInfo(
        source_path=opts.model, source_sha256=mf.sha256, entry=opts.entry, seed=opts.seed, tracer=traced.tracer,
        batch_size=batch, inputs=inputs, out_spec=traced.out_spec, output_leaves=traced.output_leaves,
        persistent=set(original), aliases=aliases, unused={k: t.detach() for k, t in unused.items()},
        unused_params={k for k, t in unused.items() if isinstance(t, torch.nn.Parameter)},
        predicted=predicted, options=options, tp=plan.tp,
        shards=dict(sharded.params) if sharded is not None else {},
        tensor_parallel=_tp_summary(sharded), recompute=plan.recompute,
    )


def _tp_summary(sharded: Sharded | None) -> dict[str, Any]:
    """The manifest's `tensor_parallel` block: the rule chosen per split node, the collectives."""
    if sharded is None:
        return {}
    report = sharded.report
    return {
        "degree": sharded.tp,
        "rules": dict(sorted(sharded.rules.items())),
        "collectives": sharded.collectives,
        "sharded_parameters": {k: str(v) for k, v in sorted(sharded.params.items())},
        "solver": {} if report is None else rounded({
            "method": report.method, "status": report.status, "objective_s": report.objective_s,
            "replicated_s": report.replicated_s, "lower_bound_s": report.lower_bound_s, "variables": report.variables}),
    }
