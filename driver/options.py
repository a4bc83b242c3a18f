"""The compile options (docs/command-line.md), their checks, and the example batch.

`check` turns the options into (stages per rank, virtual stages, microbatches) or a
PlanError naming the option and the fix; the batch helpers find the batch size and cut one
microbatch out of the example batch along each input's batch dimension.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from partitioner.errors import PlanError
from partitioner.ir import SCHEDULES
from partitioner.solve.problem import Mesh
from partitioner.trace import model_file
from runtime.precision import PRECISIONS

__all__ = ["CompileOptions", "batch_size", "check", "fixed_tp", "default_microbatches", "mesh_of", "rows_per_microbatch",
           "split_batch", "stages_per_rank"]


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
    recompute: bool = False  # activation recomputation: stages keep their inputs, run forward again in backward
    precision: str = "fp32"  # runtime.precision.PRECISIONS ([Note: mixed precision], [Note: bf16 with master weights])

    def __post_init__(self) -> None:
        """The default schedule: auto (the fastest that fits) where --devices opens a search,
        else 1f1b (docs/command-line.md)."""
        if not self.schedule:
            self.schedule = "auto" if self.devices is not None else "1f1b"


def check(opts: CompileOptions) -> tuple[int, int, int]:
    """(stages per rank, virtual stages, microbatches; 0: chosen from the batch) for
    options whose `tp` is set (see `fixed_tp`)."""
    assert opts.tp is not None, "compile_model fixes --tp before checking"
    if opts.schedule == "auto":
        raise PlanError("--schedule auto chooses the schedule while searching the meshes of --devices N: give "
                        f"--devices, or name a schedule ({', '.join(SCHEDULES)}).")
    if opts.schedule not in SCHEDULES:
        raise PlanError(f"unknown --schedule {opts.schedule!r}: choose one of {', '.join(SCHEDULES)} or auto.")
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
    if opts.schedule == "interleaved" and microbatches and microbatches % pp:
        raise PlanError(
            f"the interleaved schedule needs --microbatches to be a multiple of --stages "
            f"({microbatches} is not a multiple of {pp}): use --microbatches {2 * pp}."
        )
    if opts.zero not in (None, 0, 1):
        raise PlanError(f"--zero {opts.zero}: choose 0 (optimizer state on every replica) or 1 (sharded across the "
                        f"data-parallel replicas, ZeRO-1).")
    if opts.precision not in PRECISIONS:
        raise PlanError(f"--precision {opts.precision} is unknown: the precisions available are {', '.join(PRECISIONS)} "
                        f"(the -mixed ones: torch.autocast around every stage's forward; bf16: bfloat16 weights with "
                        f"float32 masters).")
    if opts.optimizer not in ("adam", "adamw", "sgd", "momentum"):
        raise PlanError(f"unknown --optimizer {opts.optimizer!r}: choose adam, sgd or momentum.")
    return pp, virtual, microbatches


def stages_per_rank(opts: CompileOptions) -> int:
    """The stages each pipeline rank runs: --virtual-stages under interleaved (2, the
    first count searched, where it is left out), 2 under zb-v (its V: [Note: V placement]
    in runtime/schedule.py), else 1."""
    if opts.schedule == "interleaved":
        return opts.virtual_stages if opts.virtual_stages is not None else 2
    return 2 if opts.schedule == "zb-v" else 1


def fixed_tp(opts: CompileOptions) -> CompileOptions:
    """The options with `tp` set: as given, else 1."""
    return opts if opts.tp is not None else replace(opts, tp=1)


def mesh_of(opts: CompileOptions, pp: int, virtual: int, microbatches: int) -> Mesh:
    """What the solver's problem is posed for, out of the options (`tp` fixed): `pp`
    pipeline ranks of `virtual` stages each, `microbatches`, and the limits."""
    return Mesh(pp=pp, microbatches=microbatches, schedule=opts.schedule, tp=opts.tp or 1, dp=opts.dp,
                virtual_stages=virtual, memory=opts.memory, optimizer=opts.optimizer, recompute=opts.recompute,
                zero=opts.zero or 0)


def batch_size(mf: model_file.ModelFile, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    sizes = set()
    dims = mf.batch_dims
    for key, value in [*enumerate(args), *kwargs.items()]:
        if isinstance(value, torch.Tensor):
            dim = dims.get(key, 0)
            if value.dim() <= dim:
                raise model_file.ModelFileError(
                    f"{mf.path}: input {key!r} has shape {tuple(value.shape)} and no batch dimension {dim}; "
                    f"set BATCH_DIMS = {{{key!r}: <dim>}} in the model file."
                )
            sizes.add(value.shape[dim])
    if len(sizes) != 1:
        raise model_file.ModelFileError(
            f"{mf.path}: example_inputs() tensors disagree on the batch size ({sorted(sizes)}); "
            f"dimension 0 is the batch unless BATCH_DIMS says otherwise."
        )
    return sizes.pop()


def default_microbatches(batch: int, pp: int, opts: CompileOptions) -> int:
    """2 x stages, or the largest count below it that splits the batch evenly."""
    step = pp if opts.schedule == "interleaved" else 1
    for m in range(2 * pp, 0, -1):
        if m % step == 0 and batch % (m * opts.dp) == 0:
            return m
    return 2 * pp  # nothing divides: rows_per_microbatch says so


def rows_per_microbatch(batch: int, microbatches: int, dp: int) -> int:
    if batch % (microbatches * dp):
        fits = [m for m in range(1, batch + 1) if batch % (m * dp) == 0]
        raise PlanError(
            f"the example batch of {batch} rows does not split into {microbatches} microbatches x "
            f"{dp} replicas: use --microbatches {max(m for m in fits if m <= max(microbatches, 1)) if fits else 1} "
            f"(any of {fits}) or change the batch size."
        )
    return batch // (microbatches * dp)


def split_batch(
    args: tuple[Any, ...], kwargs: dict[str, Any], dims: dict[Any, int], rows: int, index: int = 0
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Microbatch `index` of `rows` rows: each tensor sliced along its batch dimension."""

    def cut(key: Any, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        return value.narrow(dims.get(key, 0), index * rows, rows)

    return tuple(cut(i, a) for i, a in enumerate(args)), {k: cut(k, v) for k, v in kwargs.items()}
