"""The compile options (docs/command-line.md), their checks, and the example batch.

`check` turns the options into (stages per rank, virtual stages, microbatches) or a
PlanError naming the option and the fix; the batch helpers find the batch size and cut one
microbatch out of the example batch along each input's batch dimension.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.utils._pytree as pytree

from partitioner.errors import PlanError
from partitioner.ir import DEFAULT_SCHEDULE, SCHEDULES, schedule_spec
from partitioner.solve.offload import POLICIES as OFFLOAD_POLICIES
from partitioner.solve.problem import Setting
from partitioner.trace import model_file
from partitioner.trace.inputs import InputKey, flat_inputs, key_text, leaves_of
from runtime.precision import PRECISIONS

__all__ = ["AUTO", "RECOMPUTE_POLICIES", "CompileOptions", "batch_size", "check", "fixed_tp", "default_microbatches", "mesh_of",
           "rows_per_microbatch", "split_batch", "stages_per_rank"]

#: `--schedule auto`: the search chooses among the registry's `AUTO_SCHEDULES`
AUTO = "auto"
#: --recompute's choices ([Note: recomputation policies] in runtime/recompute.py)
RECOMPUTE_POLICIES = (AUTO, "none", "full", "selective")


@dataclass
class CompileOptions:
    """The command line's options (`python -m partitioner compile --help`)."""

    model: str
    out: str
    stages: int | None = None
    tp: int | None = None  # None: 1, or searched when --devices is given
    dp: int = 1
    devices: int | None = None
    microbatches: int | None = None
    schedule: str = ""  # "" (not given): auto with --devices, else 1f1b (`__post_init__`)
    virtual_stages: int | None = None  # per rank, for the interleaved schedule; None: searched (driver/phases.py)
    memory: int | None = None
    hardware: str | None = None
    analytic: bool = False
    tracer: str = "auto"
    time_limit: float = 30.0
    seed: int = 0
    entry: str = "build_model"
    optimizer: str = "adam"
    reprofile: bool = False
    repeats: int = 5
    quiet: bool = False
    meta: bool | None = None  # build on the meta device; None: when --analytic and too big to build
    #: 1: optimizer state sharded across data-parallel replicas (ZeRO-1); None: 0, or with
    #: --devices chosen per mesh, 1 where the mesh fits in memory only so (driver/search.py)
    zero: int | None = None
    #: activation recomputation ([Note: recomputation policies] in runtime/recompute.py): "none", "full",
    #: "selective" or "auto" (per rank, the cheapest that fits: driver/recompute.py); True is "full";
    #: None (not given): auto with --devices, else none (`recompute_policy`)
    recompute: bool | str | None = None
    #: activation offloading: auto (where the memory binds), none, all ([Note: offloaded
    #: activations] in partitioner/solve/offload.py)
    offload: str = "auto"
    precision: str = "fp32"  # runtime.precision.PRECISIONS ([Note: mixed precision], [Note: bf16 with master weights])
    #: write into an out folder that holds other files too, beside them ([Note: output folders] in runtime/outdir.py)
    force: bool = False

    def __post_init__(self) -> None:
        """The default schedule and recomputation: auto (the fastest that fits) where
        --devices opens a search, else 1f1b and none (docs/command-line.md)."""
        if not self.schedule:
            self.schedule = AUTO if self.devices is not None else DEFAULT_SCHEDULE
        if isinstance(self.recompute, bool):
            self.recompute = "full" if self.recompute else "none"

    @property
    def recompute_policy(self) -> str:
        """--recompute as given, or its default: auto with --devices, else none."""
        return str(self.recompute) if self.recompute is not None else AUTO if self.devices is not None else "none"


def check(opts: CompileOptions) -> tuple[int, int, int]:
    """(stages per rank, virtual stages, microbatches; 0: chosen from the batch) for
    options whose `tp` is set (see `fixed_tp`)."""
    assert opts.tp is not None, "compile_model fixes --tp before checking"
    if opts.schedule == AUTO:
        raise PlanError("--schedule auto chooses the schedule while searching the meshes of --devices N: give "
                        f"--devices, or name a schedule ({', '.join(SCHEDULES)}).")
    if opts.schedule not in SCHEDULES:
        raise PlanError(f"unknown --schedule {opts.schedule!r}: choose one of {', '.join(SCHEDULES)} or auto.")
    if opts.recompute_policy not in RECOMPUTE_POLICIES:
        raise PlanError(f"unknown --recompute {opts.recompute_policy!r}: choose one of {', '.join(RECOMPUTE_POLICIES)} "
                        f"(alone: full).")
    if opts.tp < 1:
        raise PlanError(f"--tp {opts.tp}: the tensor-parallel degree is at least 1 (1: no tensor parallelism).")
    pp = opts.stages if opts.stages is not None else 2
    if opts.devices is not None:
        if opts.devices % (opts.tp * opts.dp):
            raise PlanError(f"--devices {opts.devices} is not a multiple of tp x dp = {opts.tp * opts.dp}: give a --tp "
                            f"and --dp whose product divides --devices, or leave them out to let the search choose.")
        pp = opts.stages if opts.stages is not None else opts.devices // (opts.tp * opts.dp)
        if pp * opts.tp * opts.dp != opts.devices:
            raise PlanError(f"--stages {pp} x --tp {opts.tp} x --dp {opts.dp} != --devices {opts.devices}: leave one of "
                            f"--stages/--tp out and --devices sets it, or drop --devices.")
    if pp < 1:
        raise PlanError(f"--stages {pp}: a pipeline needs at least 1 stage; use --stages 2 or more.")
    if opts.dp < 1:
        raise PlanError(f"--dp {opts.dp}: needs at least 1 replica.")
    if opts.virtual_stages is not None and opts.virtual_stages < 1:
        raise PlanError(f"--virtual-stages {opts.virtual_stages}: a rank runs at least 1 stage; give 2 or more for "
                        f"the interleaved schedule, or leave it out to let the planner choose.")
    virtual = stages_per_rank(opts)
    microbatches = opts.microbatches if opts.microbatches is not None else 0  # 0: chosen from the batch
    if opts.microbatches is not None and microbatches < 1:
        raise PlanError(f"--microbatches {microbatches}: needs at least 1.")
    multiple = schedule_spec(opts.schedule).microbatch_multiple(pp)
    if microbatches and microbatches % multiple:
        raise PlanError(
            f"the {opts.schedule} schedule needs --microbatches to be a multiple of --stages "
            f"({microbatches} is not a multiple of {pp}): use --microbatches {2 * pp}."
        )
    if opts.zero not in (None, 0, 1):
        raise PlanError(f"--zero {opts.zero}: choose 0 (optimizer state on every replica) or 1 (sharded across the "
                        f"data-parallel replicas, ZeRO-1).")
    if opts.precision not in PRECISIONS:
        raise PlanError(f"--precision {opts.precision} is unknown: the precisions available are {', '.join(PRECISIONS)} "
                        f"(the -mixed ones: torch.autocast around every stage's forward; bf16: bfloat16 weights with "
                        f"float32 masters).")
    if opts.offload not in OFFLOAD_POLICIES:
        raise PlanError(f"--offload {opts.offload}: choose auto (offload activations to the host only where the mesh "
                        f"does not fit otherwise), none or all.")
    if opts.optimizer not in ("adam", "adamw", "sgd", "momentum"):
        raise PlanError(f"unknown --optimizer {opts.optimizer!r}: choose adam, sgd or momentum.")
    return pp, virtual, microbatches


def stages_per_rank(opts: CompileOptions) -> int:
    """The stages each pipeline rank runs: the schedule's own count (2 under zb-v, its V:
    [Note: V placement] in runtime/schedule/registry.py; 1 mostly), else --virtual-stages
    (interleaved; 2, the first count searched, where it is left out)."""
    return schedule_spec(opts.schedule).stages_on_each_rank(opts.virtual_stages or 2)


def fixed_tp(opts: CompileOptions) -> CompileOptions:
    """The options with `tp` set: as given, else 1."""
    return opts if opts.tp is not None else replace(opts, tp=1)


def mesh_of(opts: CompileOptions, pp: int, virtual: int, microbatches: int) -> Setting:
    """What the solver's problem is posed for, out of the options (`tp` fixed): `pp`
    pipeline ranks of `virtual` stages each, `microbatches`, and the limits."""
    return Setting(pp=pp, microbatches=microbatches, schedule=opts.schedule, tp=opts.tp or 1, dp=opts.dp,
                virtual_stages=virtual, memory=opts.memory, optimizer=opts.optimizer,
                recompute=None if opts.recompute_policy == AUTO else opts.recompute_policy,
                zero=opts.zero or 0, offload=opts.offload == "all")


def batch_size(mf: model_file.ModelFile, args: tuple[Any, ...], kwargs: dict[str, Any],
               dims: dict[InputKey, int]) -> int:
    """The rows of the example batch: every tensor leaf's size along its batch dimension
    (`dims`, [Note: input leaves]), which must agree."""
    sizes = set()
    for key, value in flat_inputs(args, kwargs).items():
        if isinstance(value, torch.Tensor):
            dim = dims.get(key, 0)
            if value.dim() <= dim:
                raise model_file.ModelFileError(
                    f"{mf.path}: input {key_text(key)} has shape {tuple(value.shape)} and no batch dimension {dim}; "
                    f"set BATCH_DIMS = {{{key_text(key)}: <dim>}} in the model file."
                )
            sizes.add(value.shape[dim])
    if len(sizes) != 1:
        raise model_file.ModelFileError(
            f"{mf.path}: example_inputs() tensors disagree on the batch size ({sorted(sizes)}); "
            f"dimension 0 is the batch unless BATCH_DIMS says otherwise (by position, name or dotted path: "
            f"{{'hidden': 1}}, {{'hidden.0': 1}})."
        )
    return sizes.pop()


def default_microbatches(batch: int, pp: int, opts: CompileOptions) -> int:
    """2 x stages, or the largest count below it that splits the batch evenly."""
    step = schedule_spec(opts.schedule).microbatch_multiple(pp)
    for m in range(2 * pp, 0, -1):
        if m % step == 0 and batch % (m * opts.dp) == 0:
            return m
    return 2 * pp  # nothing divides: rows_per_microbatch says so


def rows_per_microbatch(batch: int, microbatches: int, dp: int) -> int:
    """Rows in one microbatch of one replica; a PlanError naming a fix where they do not divide."""
    if batch % (microbatches * dp):
        raise PlanError(f"the example batch of {batch} rows does not split into {microbatches} microbatches x "
                        f"{dp} replicas: {_batch_fix(batch, microbatches, dp)}")
    return batch // (microbatches * dp)


def _batch_fix(batch: int, microbatches: int, dp: int) -> str:
    """What makes `batch` split into microbatches x dp: a microbatch count where dp divides
    the batch, else a dp that keeps the microbatches, and always a batch size that fits."""
    fits = _divisors(batch // dp) if batch % dp == 0 else []
    whole = microbatches * dp
    resize = f"an example batch of a multiple of {microbatches} x {dp} = {whole} rows (e.g. {-(-batch // whole) * whole})"
    if fits:
        best = max(m for m in fits if m <= microbatches)
        return f"use --microbatches {best} (any of {fits}) or {resize}."
    dps = [d for d in _divisors(batch) if batch % (d * microbatches) == 0]
    if dps:
        return f"--dp {dp} does not divide {batch} rows: use --dp {' or '.join(map(str, dps))}, or {resize}."
    return f"no --dp divides {batch} rows into {microbatches} microbatches: use {resize}."


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def split_batch(
    args: tuple[Any, ...], kwargs: dict[str, Any], dims: dict[InputKey, int], rows: int, index: int = 0
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Microbatch `index` of `rows` rows: each tensor leaf sliced along its batch dimension
    (`dims`, [Note: input leaves])."""

    def cut(top: int | str, value: Any) -> Any:
        leaves = [v.narrow(dims.get(k, 0), index * rows, rows) if isinstance(v, torch.Tensor) else v
                  for k, v in leaves_of(top, value)]
        return pytree.tree_unflatten(leaves, pytree.tree_flatten(value)[1])

    return tuple(cut(i, a) for i, a in enumerate(args)), {k: cut(k, v) for k, v in kwargs.items()}
