"""The phases of one compile, each a call into one package of the planner or into codegen;
`driver.compile.compile_model` lists them in order, `driver.search` reuses them per mesh.

[Note: where the compile runs the model]
    A measured compile (not --analytic, not --meta) on a machine with CUDA, for a GPU's
    hardware profile (any but the measured cpu one: a built-in a100/h100/h200, a JSON
    profile, or by default this machine's, which is the built-in of its GPU when that is an
    A100, H100 or H200, else the cpu one), moves the model and its example batch to the
    current CUDA device before tracing, and times and counts memory there with CUDA's timer
    (partitioner/cost/timer.py). Anything else runs on the CPU, as a compile always did:
    analytic costs do not depend on the device, and the measured `cpu` profile describes the
    CPU. The device is part of every measured cost's cache key (`DeviceTimer.key`), and
    nothing of it reaches the package: stage code names no device ([Note: devices in stage
    code] in codegen/stage.py) and constants are saved from the CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Any, Callable

import torch
import torch.fx
import torch.utils._pytree as pytree

from codegen import emit
from partitioner.cost.hardware import Hardware, load_hardware
from partitioner.cost.measure import rank_threads
from partitioner.cost.timer import device_timer
from partitioner.cost.costmodel import computing_blocks
from partitioner.cost.nodes import compute_nodes, working_nodes
from partitioner.errors import PlanError
from partitioner.ir import NodeCost, Plan, SolverReport, StagePlan
from partitioner.predict.predict import predict, rounded
from partitioner.solve.problem import coarse_graph, make_plan, pose
from partitioner.solve.solve import fills_with_compute, solve
from partitioner.tp import Sharded, shard
from partitioner.trace import model_file
from partitioner.trace.checkpointing import describe
from partitioner.trace.fake import on_fake_cpu, to_meta
from partitioner.trace.inputs import InputKey
from partitioner.trace.buffers import BufferSnapshot, kept_buffers, warn_batch_statistics
from partitioner.trace.modes import check_modes, note_dropout
from partitioner.trace.passes import probe, propagate, specialize
from partitioner.trace.trace import Traced, by_input_key, check_autocast, copy_traced, trace
from runtime.precision import autocast, cast_inputs, cast_model

from .check import calibration_block, check_plan
from .costs import loss_costs, node_costs, calibrated_costs, stage_peaks
from .options import (CompileOptions, batch_size, check, default_microbatches, fixed_tp, mesh_of, rows_per_microbatch,
                      split_batch)
from .package_info import model_flops, package_info
from .prepared import Compiled, Prepared, Source

__all__ = ["apply_tp", "assign_nodes", "compile_device", "emit_plan", "finish", "keep_checkpointing", "load_source",
           "prepare", "solve_problem"]


def load_source(opts: CompileOptions, say: Callable[[str], None] = lambda _m: None) -> Source:
    """Load the model file, build the model (on the meta device when `_build` says so)
    and take its example batch (moved to the meta device with a meta model, to the GPU
    for a measured compile there: [Note: where the compile runs the model])."""
    mf = model_file.load(opts.model, opts.entry)
    model = cast_model(_build(mf, opts, say), opts.precision)  # [Note: bf16 with master weights]
    args, kwargs = cast_inputs(mf.example_inputs(), opts.precision)
    device = compile_device(opts)  # the CPU for a meta model: it is --meta's or --analytic's
    if _is_meta(model):
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
    elif device.type == "cuda":
        model = model.to(device)
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), (args, kwargs))
    return Source(mf, model, args, kwargs, batch_size(mf, args, kwargs, mf.leaf_batch_dims(model, args, kwargs)), device)


def compile_device(opts: CompileOptions) -> torch.device:
    """Where a compile runs the model: the current CUDA device for a measured compile
    for a GPU's profile on a machine with CUDA, else the CPU ([Note: where the compile runs
    the model])."""
    if opts.analytic or opts.meta or not torch.cuda.is_available():
        return torch.device("cpu")
    if load_hardware(opts.hardware).name == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def prepare(opts: CompileOptions, say: Callable[[str], None] = lambda _m: None, source: Source | None = None) -> Prepared:
    """Phases 1-4 of a compile (`driver.compile.compile_model`) and the problem of phase 5:
    load, trace, specialise and cost the model; split it for tensor parallelism; pose the
    partition problem.  `source`: the model file already loaded (`load_source`)."""
    opts = fixed_tp(opts)
    timings: dict[str, float] = {}
    clock = time.perf_counter()

    def phase(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        timings[name] = now - clock
        clock = now

    pp, virtual, microbatches = check(opts)
    # 1. load: the model file and one microbatch of its example batch (partitioner.trace.model_file).
    src = source or load_source(opts, say)
    mf, model, args, kwargs, batch = src.mf, src.model, src.args, src.kwargs, src.batch
    microbatches = microbatches or default_microbatches(batch, pp, opts)
    rows = rows_per_microbatch(batch, microbatches, opts.dp)
    dims = mf.leaf_batch_dims(model, args, kwargs)  # [Note: input leaves]
    margs, mkwargs = split_batch(args, kwargs, dims, rows)
    phase("load")
    # 2. trace, and specialise to the microbatch shape (partitioner.trace).
    buffers = BufferSnapshot(model)  # running the model moves BatchNorm's statistics (partitioner.trace.buffers)
    traced = _trace(src, margs, mkwargs, opts, rows, say)
    check_autocast(traced, opts.precision)
    opts = keep_checkpointing(opts, traced.checkpointed, say)
    hardware = load_hardware(opts.hardware)
    timer = device_timer(src.device)  # [Note: where the compile runs the model]
    with _shape_run(src, traced, by_input_key(margs, mkwargs), opts.precision) as by_key:
        # the values' dtypes are the autocast run's ([Note: mixed precision])
        with autocast(opts.precision, src.device.type):
            free = probe(traced.gm, by_key, traced.input_keys, dims, rows)  # [Note: free batch]
            values = propagate(traced.gm, [by_key[key] for _name, key in traced.input_keys], opts.model)
        free_batch = specialize(traced.gm, values, free, rows)
        warn_batch_statistics(traced.gm, microbatches, None if opts.quiet else say)
        check_modes(traced.gm)  # [Note: modes in generated code]
        note_dropout(traced.gm, None if opts.quiet else say)
        phase("trace")
        # 3. cost every node, measured (cached) or analytic (partitioner.cost).
        with rank_threads(), autocast(opts.precision, src.device.type):  # measured as a rank will compute
            costs = node_costs(traced.gm, values, hardware, opts, say, timer)
            loss = loss_costs(mf, traced, values, hardware, opts, batch, rows, say, timer)
    values = to_meta(values)  # [Note: mixed precision on the meta device]
    buffers.restore()
    phase("cost")
    # 4. tp: the split per node, and the graph one rank runs (partitioner.tp).
    whole = (traced, costs)
    traced, costs, sharded = apply_tp(traced, costs, opts.tp or 1, hardware, opts, say)
    phase("tp")
    # 5. solve, first half: coarsen into blocks, pose the problem for the mesh (partitioner.solve).
    coarse = coarse_graph(traced, costs, sharded, loss)
    mesh = mesh_of(opts, pp, virtual, microbatches)
    problem = pose(coarse, mesh, hardware)
    phase("coarsen")
    return Prepared(opts=opts, mf=mf, model=model, traced=traced, costs=costs, hardware=hardware, problem=problem,
                    blocks=coarse.blocks, batch=batch, rows=rows, args=args, kwargs=kwargs, mesh=mesh, timings=timings,
                    whole=whole, sharded=sharded, coarse=coarse, values=values if sharded is None else None, say=say,
                    free_batch=free_batch, loss=loss, timer=timer)


def _trace(src: Source, margs: tuple[Any, ...], mkwargs: dict[str, Any], opts: CompileOptions, rows: int,
           say: Callable[[str], None]) -> Traced:
    """The model's graph for this microbatch, to specialise: a copy of its fx trace when
    `src` has one (kept from an earlier shape), else a new trace."""
    if src.generic is not None:
        return copy_traced(src.generic)
    say(f"tracing {opts.model} ({type(src.model).__name__}, microbatch of {rows} rows)")
    traced = trace(src.model, margs, mkwargs, opts.tracer, opts.model, src.mf.leaf_batch_dims(src.model, margs, mkwargs))
    if traced.tracer == "fx":
        src.generic = copy_traced(traced)
    return traced


def keep_checkpointing(opts: CompileOptions, regions: tuple[str, ...], say: Callable[[str], None]) -> CompileOptions:
    """`opts` with recomputation on where the model checkpoints regions itself and no mesh is
    searched ([Note: the user's checkpointing] in partitioner/trace/checkpointing.py); under
    a search (`--devices`) the planner chooses, and `driver.search` says so."""
    if not regions or opts.devices is not None:
        return opts
    say(f"the model's own gradient checkpointing (torch.utils.checkpoint around {describe(regions)}) is traced as the "
        f"ops it runs and kept as the plan's recomputation: every stage runs its forward again in backward "
        f"(--recompute)")
    return dataclasses.replace(opts, recompute=True)


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


def solve_problem(p: Prepared) -> tuple[tuple[int, ...], SolverReport]:
    """Phase 5: the stage of every block of `p.problem` (partitioner.solve)."""
    start = time.perf_counter()
    p.say(f"solving: {len(compute_nodes(p.traced.gm))} nodes in {p.problem.num_blocks} blocks "
          f"into {p.problem.stages} stages")
    if not fills_with_compute(p.problem):
        p.say(f"warning: the model has {len(working_nodes(p.traced.gm))} nodes that compute (views, buffer updates "
              f"and constant masks do not), in {len(computing_blocks(p.problem))} blocks, fewer than the "
              f"{p.problem.stages} stages: some stage will only pass values on; use fewer stages to give every rank "
              f"work.")
    assignment, report = solve(p.problem, time_limit_s=p.opts.time_limit)
    p.timings["solve"] = time.perf_counter() - start
    return assignment, report


def finish(prepared: Prepared, assignment: tuple[int, ...], report: SolverReport | None = None,
           extra: dict[str, Any] | None = None) -> Compiled:
    """Turn a stage per block into a Plan, then phases 6 and 7 (`extra` joins `predicted`)."""
    p = prepared
    if report is not None:
        report = dataclasses.replace(report, nodes=len(compute_nodes(p.traced.gm)), blocks=p.problem.num_blocks)
    # the stages timed as they run, buffers kept
    with autocast(p.opts.precision, p.timer.device.type), kept_buffers(p.model):
        p, plan, resolved, calibrated = check_plan(p, make_plan(p.problem, p.blocks, assignment, report, p.mesh))
    return emit_plan(p, plan, extra, resolved=resolved, calibrated=calibrated)


def emit_plan(p: Prepared, plan: Plan, extra: dict[str, Any] | None = None, *, resolved: bool = False,
              calibrated: dict[str, NodeCost] | None = None) -> Compiled:
    """Phases 6 and 7 for `plan`: predict its step, emit its package; `resolved`: the plan
    was solved again with measured stage times ([Note: the model against the machine]);
    `calibrated`: the node costs already calibrated for `plan`."""
    start = time.perf_counter()
    # 6. predict the step (partitioner.predict), on node costs calibrated per stage where they are measured.
    with autocast(p.opts.precision, p.timer.device.type), kept_buffers(p.model):
        costs = calibrated if calibrated is not None else calibrated_costs(p, plan)
        peaks = stage_peaks(p, plan)
    predicted = predict(p.traced.gm, plan, costs, p.hardware, cost_source="analytic" if p.opts.analytic else "measured",
                        model_flops=model_flops(p), loss=p.loss, precision=p.opts.precision)
    predicted.update(rounded({**calibration_block(p, plan, costs, resolved, peaks), **(extra or {})}))
    # 7. emit the package's files (codegen).
    manifest = emit(p.opts.out, p.traced.gm, plan, package_info(p, plan, predicted))
    p.timings["emit"] = time.perf_counter() - start
    return Compiled(manifest=manifest, plan=plan, traced=p.traced, costs=costs, timings=dict(p.timings))


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
    mesh = p.mesh
    plan = Plan(stages=tuple(stages), schedule=mesh.schedule, microbatches=mesh.microbatches,
                pp=count // mesh.virtual_stages, tp=mesh.tp, dp=mesh.dp, virtual_stages=mesh.virtual_stages)
    return emit_plan(p, plan)


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


def _shape_run(src: Source, traced: Traced, by_key: dict[InputKey, Any], precision: str
               ) -> contextlib.AbstractContextManager[dict[InputKey, Any]]:
    """Where the graph runs while its values and costs are found: on fake CPU tensors for
    a mixed precision on a model built on the meta device ([Note: mixed precision on the
    meta device] in partitioner/trace/fake.py), else on `by_key` as it is."""
    if precision in ("bf16-mixed", "fp16-mixed") and _is_meta(src.model):
        return on_fake_cpu(traced.gm, by_key)
    return contextlib.nullcontext(by_key)


def _is_meta(model: torch.nn.Module) -> bool:
    return any(t.is_meta for t in model.state_dict().values())
