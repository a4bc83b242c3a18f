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

[Note: splits chosen by the simulator]
    The solver minimises interleaved 1F1B's slowest virtual stage, whose closed form,
    (M v + p - 1) x that stage, is exact only where the stages are equal ([Note: what the
    schedule runs] in partitioner/solve/model.py).  So the driver simulates a few
    candidate splits and keeps the fastest: the solver's plan and the split of the compute
    into even prefix sums (`even_split`: Megatron-LM's even layers, on a chain of equal
    layers), each where it fits; a tie goes to the solver's.  With --virtual-stages left
    out, every count v from 2 to `most_virtual` is posed, solved and simulated alike, the
    layers per virtual stage a consequence of the split (no count needs to divide them):
    v = 2 as a given count is, the others by the interval DP alone (CP-SAT on pp x v stages
    takes its whole time limit), until one does not fit the memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
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
from partitioner.errors import InfeasiblePlanError, PlanError
from partitioner.ir import NodeCost, Plan, SolverReport, StagePlan
from partitioner.predict.predict import predict, rounded, simulate_plan
from partitioner.solve.problem import coarse_graph, make_plan, pose
from partitioner.solve.solve import even_split, fills_with_compute, objective, solve
from partitioner.tp import Sharded, shard
from partitioner.trace import model_file
from partitioner.trace.checkpointing import describe
from partitioner.trace.fake import on_fake_cpu, to_meta
from partitioner.trace.inputs import InputKey
from partitioner.trace.buffers import (BufferSnapshot, kept_buffers, warn_batch_statistics, warn_state_updates,
                                       warn_train_only_updates)
from partitioner.trace.modes import check_modes, note_dropout
from partitioner.trace.passes import probe, propagate, specialize
from partitioner.trace.trace import Traced, by_input_key, check_autocast, copy_traced, trace
from runtime.precision import autocast, cast_inputs, cast_model

from . import offloading
from .check import calibration_block, check_plan
from .costs import loss_costs, node_costs, calibrated_costs, stage_peaks
from .loss_check import loss_reduction
from .memory import check_fits
from .options import (CompileOptions, batch_size, check, default_microbatches, fixed_tp, mesh_of, rows_per_microbatch,
                      split_batch)
from .package_info import model_flops, package_info
from .prepared import Compiled, Prepared, Source
from .recompute import planned, recompute_block

__all__ = ["MAX_VIRTUAL", "apply_tp", "assign_nodes", "choose_split", "compile_device", "emit_plan", "finish",
           "keep_checkpointing", "load_source", "most_virtual", "prepare", "solve_interleaved", "solve_problem",
           "virtual_counts"]


def load_source(opts: CompileOptions, say: Callable[[str], None] = lambda _m: None,
                example: tuple[tuple[Any, ...], dict[str, Any]] | None = None) -> Source:
    """Load the model file, build the model (on the meta device when `_build` says so)
    and take its example batch (moved to the meta device with a meta model, to the GPU
    for a measured compile there: [Note: where the compile runs the model]).  `example`:
    the batch as (args, kwargs) when the caller has it (`partitioner.parallelize`), else
    the model file's `example_inputs()`."""
    mf = model_file.load(opts.model, opts.entry)
    model = cast_model(_build(mf, opts, say), opts.precision)  # [Note: bf16 with master weights]
    args, kwargs = cast_inputs(example if example is not None else mf.example_inputs(), opts.precision)
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
            free = probe(traced.gm, by_key, traced.input_keys, dims, rows, src.probes())  # [Note: free batch]
            values = propagate(traced.gm, [by_key[key] for _name, key in traced.input_keys], opts.model)
            src.ran(rows, values)
        free_batch = specialize(traced.gm, values, free, rows)
        warn_batch_statistics(traced.gm, microbatches, None if opts.quiet else say)
        warn_state_updates(traced.gm, microbatches, None if opts.quiet else say)
        warn_train_only_updates(traced.gm, model, margs, mkwargs, None if opts.quiet else say)
        check_modes(traced.gm)  # [Note: modes in generated code]
        note_dropout(traced.gm, None if opts.quiet else say)
        phase("trace")
        reduction = loss_reduction(mf, traced, values, dims, batch, rows, say)  # [Note: the loss's reduction]
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
                    free_batch=free_batch, loss=loss, loss_reduction=reduction, timer=timer)


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
    a search (`--devices`) the planner chooses, and `driver.search` says so; a --recompute
    given stands."""
    if not regions or opts.devices is not None or opts.recompute is not None:
        return opts
    say(f"the model's own gradient checkpointing (torch.utils.checkpoint around {describe(regions)}) is traced as the "
        f"ops it runs and kept as the plan's recomputation: every stage runs its forward again in backward "
        f"(--recompute)")
    return dataclasses.replace(opts, recompute="full")


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
    assignment, report = offloading.solve_offloading(p, solve)
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
        plan = planned(p, assignment, report)  # [Note: recomputation chosen per rank]
        p, plan, resolved, calibrated = check_plan(p, plan)
    plan, offloaded = offloading.offload(p, plan)
    check_fits(p, plan)  # never a package that exceeds the memory it was given
    return emit_plan(p, plan, {**offloaded, **recompute_block(p, plan), **(extra or {})}, resolved=resolved, calibrated=calibrated)


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
        # under the same autocast: what each stage saves is counted on its nodes run again
        predicted = predict(p.traced.gm, plan, costs, p.hardware, cost_source="analytic" if p.opts.analytic else "measured",
                            model_flops=model_flops(p), loss=p.loss, precision=p.opts.precision,
                            optimizer_factor=p.problem.optimizer_factor, values=p.values)
    predicted.update(rounded({**calibration_block(p, plan, costs, resolved, peaks), **(extra or {})}))
    # 7. emit the package's files (codegen).
    manifest = emit(p.opts.out, p.traced.gm, plan, package_info(p, plan, predicted), force=p.opts.force)
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


# -- interleaved: the split and its stages per rank chosen by the simulator ----------------

#: the most stages per rank searched (Megatron-LM's production recipes run 5 to 20)
MAX_VIRTUAL = 20
#: a candidate replaces the best found only when faster by more than this (float sums)
_TIE = 1e-9

_Solved = tuple[Prepared, tuple[int, ...], SolverReport]


def most_virtual(pp: int, blocks: int) -> int:
    """The most stages per rank worth a try: a block per stage at least, MAX_VIRTUAL at most."""
    return max(2, min(MAX_VIRTUAL, blocks // pp))


def virtual_counts(given: int | None, pp: int, blocks: int) -> tuple[int, ...]:
    """The stages per rank to try: the count given (--virtual-stages), else 2 to `most_virtual`."""
    return (given,) if given is not None else tuple(range(2, most_virtual(pp, blocks) + 1))


def solve_interleaved(p: Prepared, solve_one: Callable[[Prepared], tuple[tuple[int, ...], SolverReport]]) -> _Solved:
    """The fastest simulated plan over the stages per rank to try: the first count solved
    by `solve_one` (CP-SAT where it serves, the errors that explain), the rest by the DP
    alone, up to the first that does not fit, since what a rank holds in flight grows with
    its count ([Note: splits chosen by the simulator])."""
    counts = virtual_counts(p.opts.virtual_stages, p.mesh.pp, p.problem.num_blocks)
    q = p if counts[0] == p.mesh.virtual_stages else _repose(p, counts[0])
    assignment, report = solve_one(q)
    best = (*choose_split(q, assignment, report), q)
    tried = [f"v={counts[0]} {best[0] * 1e3:.3f} ms"]
    for v in counts[1:]:
        q = _repose(p, v)
        try:
            assignment, report = solve(q.problem, time_limit_s=0.0, explain=False)
        except InfeasiblePlanError:
            break
        except PlanError:
            continue
        found = (*choose_split(q, assignment, report), q)
        tried.append(f"v={v} {found[0] * 1e3:.3f} ms")
        if found[0] < best[0] * (1 - _TIE):
            best = found
    if len(tried) > 1:
        p.say(f"interleaved: {best[3].mesh.virtual_stages} stages per rank, the fastest simulated ({', '.join(tried)})")
    return best[3], best[1], best[2]


def choose_split(p: Prepared, assignment: tuple[int, ...], report: SolverReport
                 ) -> tuple[float, tuple[int, ...], SolverReport]:
    """The simulated step of the fastest candidate split of `p.problem`, that split, and the
    solver's report with its objective ([Note: splits chosen by the simulator])."""
    best_step, best = _simulated(p, assignment, report), assignment
    even = even_split(p.problem)
    if even != assignment and math.isfinite(objective(p.problem, even)):
        step = _simulated(p, even, report)
        if step < best_step * (1 - _TIE):
            best_step, best = step, even
    if best is not assignment:
        report = dataclasses.replace(report, objective_s=objective(p.problem, best), method=report.method + "+even")
    return best_step, best, report


def _simulated(p: Prepared, assignment: tuple[int, ...], report: SolverReport) -> float:
    """The step the simulator predicts for `assignment` (what `predict` reports)."""
    plan = make_plan(p.problem, p.blocks, assignment, report, p.mesh)
    return simulate_plan(p.traced.gm, plan, p.costs, p.hardware, p.loss).step_time_s


def _repose(p: Prepared, virtual: int) -> Prepared:
    """`p` posed again with `virtual` stages per rank (same trace, costs and blocks)."""
    assert p.coarse is not None
    mesh = dataclasses.replace(p.mesh, virtual_stages=virtual)
    return dataclasses.replace(p, opts=dataclasses.replace(p.opts, virtual_stages=virtual), mesh=mesh,
                               problem=pose(p.coarse, mesh, p.hardware))
