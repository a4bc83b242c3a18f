"""The schedule registry: every pipeline schedule a package may name, as one frozen spec.

Wherever a schedule matters (the command line, the manifest's check, the mesh search,
the solver's memory model, stage placement, the runtimes) it is read from its
`ScheduleSpec` here, never compared by name.  This module imports the action IR and the
builders alone, so the planner's IR (partitioner/ir.py) imports it without the runtime.

[Note: V placement]
    Stage s runs on pipeline rank s % p (`placement`), so the interleaved schedule's
    stages go round the ranks; under zb-v the 2p stages go down the ranks and back up
    in a V: stage s on rank s for s < p, on rank 2p-1-s after, so rank r holds stages r
    and 2p-1-r, the first and last stage are both on rank 0, and stages p-1 and p hand
    over on rank p-1 in memory.  The solver's split into 2p stages is the same; codegen
    writes each stage's `ranks` from `placement`, and `StageGraph.from_manifest` places
    the stages by the manifest's schedule (the runtime checks the two agree).

[Note: activations in flight]
    What the memory model charges each stage for (`ScheduleSpec.inflight`, read by
    `PartitionProblem.inflight`): the microbatches whose activations stage k of S holds
    at its peak, M microbatches in all.  GPipe runs every forward first: M.  1F1B holds
    min(S - k, M): stage k's warm-up.  Interleaved 1F1B has no such simple form (its
    warm-up runs each rank's chunks in turns of p microbatches, so a middle stage may hold
    more than its place in the pipeline says: 4 ranks x 2 stages, 8 microbatches, holds
    [8, 8, 7, 5, 4, 4, 3, 1]), so it is counted from the schedule's own shape
    (`_interleaved_peaks`).  ZB-H1 holds 1F1B's first-stage peak min(S, M) on every rank
    (its W's held back), ZB-H2 twice it, min(2S, M); ZB-V, on 2p stages, 1F1B's
    min(S - k, M) ([Note: zero-bubble orders] in runtime/zero_bubble.py).  The simulator
    counts the same peaks (partitioner/predict/simulate.py).

[Note: weight gradients awaited]
    Under a split backward a stage keeps, from each microbatch's I to its W, the gradients
    of its weighted ops' outputs (the seeds W reads, [Note: weight-gradient seeds] in
    runtime/split_backward.py), and the zero-bubble schedules hold W back to fill their
    bubbles: `ScheduleSpec.awaiting_w` is the most microbatches a stage has run I but not
    yet W for.  ZB-H1 holds back min(k + 1, M) on stage k, ZB-H2 min(2k + 1, M) (its W's
    fill twice the warm-up), ZB-V min(k + 1, M) on the way down the V and max(1, p +
    min(p, M) - 1 - k) on the way up (stages k >= p); a schedule that does not split its
    backward, none.  Each is the count its builder's rows give, checked on every shape up
    to 16 ranks (tests/runtime/test_registry.py); the memory model charges a
    stage its seeds that many times (`PartitionProblem.awaiting_w`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from ..errors import ScheduleError
from .actions import Schedule
from .builders import gpipe, interleaved_1f1b, interleaved_warmup, one_f_one_b, zb_h1, zb_h2, zb_v

__all__ = [
    "ScheduleSpec",
    "REGISTRY",
    "SCHEDULES",
    "AUTO_SCHEDULES",
    "DEFAULT_SCHEDULE",
    "UnknownScheduleError",
    "schedule_spec",
    "names",
    "placement",
    "make_schedule",
]

Builder = Callable[[int, int, int], Schedule]  # (ranks, microbatches, stages per rank) -> compute schedule
Inflight = Callable[[int, int, int, int], int]  # (ranks, stages, stage, microbatches) -> held at the peak


class UnknownScheduleError(ScheduleError):
    """A schedule name the registry does not hold."""


@dataclass(frozen=True)
class ScheduleSpec:
    """One pipeline schedule: how to build it and what the planner needs to know of it."""

    name: str
    build: Builder
    #: stages each pipeline rank runs; None: the package's choice (--virtual-stages)
    stages_per_rank: int | None
    #: whether the backward is split in I and W ([Note: split backward] in runtime/stage.py)
    splits_backward: bool
    #: microbatches held at a stage's peak ([Note: activations in flight])
    inflight_of: Inflight
    #: whether `--schedule auto` may choose it
    auto: bool
    #: whether the microbatch count must be a multiple of the pipeline ranks
    microbatches_per_rank: bool = False
    #: stages placed in a V rather than round the ranks ([Note: V placement])
    vee: bool = False
    #: microbatches past I and not yet W at a stage's most ([Note: weight gradients awaited])
    awaiting_w_of: Inflight | None = None

    def microbatch_multiple(self, ranks: int) -> int:
        """The number every microbatch count must be a multiple of, on `ranks` ranks."""
        return ranks if self.microbatches_per_rank else 1

    def stages_on_each_rank(self, virtual_stages: int) -> int:
        """Stages per rank: the schedule's own count, else `virtual_stages` (the option)."""
        return self.stages_per_rank if self.stages_per_rank is not None else virtual_stages

    def inflight(self, ranks: int, stages: int, stage: int, microbatches: int) -> int:
        """Microbatches whose activations stage `stage` of `stages` (on `ranks` ranks) holds
        at its peak."""
        return self.inflight_of(ranks, stages, stage, microbatches)

    def inflights(self, ranks: int, stages: int, microbatches: int) -> tuple[int, ...]:
        """`inflight` of every stage, made once per shape (the planner asks per stage and run)."""
        return _inflights(self.inflight_of, ranks, stages, microbatches)

    def awaiting_w(self, ranks: int, stages: int, microbatches: int) -> tuple[int, ...]:
        """Of every stage, the most microbatches whose I it has run and whose W it has not
        ([Note: weight gradients awaited]); zeros where the backward is whole."""
        if self.awaiting_w_of is None:
            return (0,) * stages
        return _inflights(self.awaiting_w_of, ranks, stages, microbatches)

    def placement(self, num_stages: int, ranks: int) -> tuple[int, ...]:
        """The pipeline rank of each stage ([Note: V placement])."""
        return _placement(self.vee, num_stages, ranks)

    def make(self, ranks: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
        """The compute schedule of a package of `ranks` ranks, `virtual_stages` stages each."""
        if self.stages_per_rank is not None and virtual_stages != self.stages_per_rank:
            raise ScheduleError(
                f"schedule {self.name!r} runs {_count(self.stages_per_rank)} stage{'s' if self.stages_per_rank > 1 else ''} "
                f"per rank but the package has {virtual_stages}: run the package with the schedule it was compiled "
                f"for, or compile with --schedule {self.name}.")
        return self.build(ranks, microbatches, virtual_stages)


@functools.lru_cache(maxsize=4096)
def _inflights(inflight_of: Inflight, ranks: int, stages: int, microbatches: int) -> tuple[int, ...]:
    return tuple(inflight_of(ranks, stages, k, microbatches) for k in range(stages))


@functools.lru_cache(maxsize=4096)
def _placement(vee: bool, num_stages: int, ranks: int) -> tuple[int, ...]:
    """`ScheduleSpec.placement`, made once per shape: the planner asks for a stage's rank
    once per node and walk step."""
    if vee:
        return tuple(s if s < ranks else 2 * ranks - 1 - s for s in range(num_stages))
    return tuple(s % ranks for s in range(num_stages))


def _every_microbatch(ranks: int, stages: int, stage: int, microbatches: int) -> int:
    return microbatches


def _warmup(ranks: int, stages: int, stage: int, microbatches: int) -> int:
    return min(stages - stage, microbatches)


def _first_stage_peak(ranks: int, stages: int, stage: int, microbatches: int) -> int:
    return min(stages, microbatches)


def _twice_first_stage_peak(ranks: int, stages: int, stage: int, microbatches: int) -> int:
    return min(2 * stages, microbatches)


def _one_w_per_stage(ranks: int, stages: int, stage: int, microbatches: int) -> int:
    return min(stage + 1, microbatches)


def _two_w_per_stage(ranks: int, stages: int, stage: int, microbatches: int) -> int:
    return min(2 * stage + 1, microbatches)


def _down_and_up_the_vee(ranks: int, stages: int, stage: int, microbatches: int) -> int:
    if stage < ranks:
        return min(stage + 1, microbatches)
    return max(1, ranks + min(ranks, microbatches) - 1 - stage)


def _interleaved_peak(ranks: int, stages: int, stage: int, microbatches: int) -> int:
    return _interleaved_peaks(ranks, microbatches, stages // ranks)[stage]


@functools.lru_cache(maxsize=4096)
def _interleaved_peaks(ranks: int, microbatches: int, virtual_stages: int) -> tuple[int, ...]:
    """Each stage's most microbatches held at once in interleaved 1F1B (an F keeps its
    activations, a B frees them: [Note: activations in flight]), counted from the
    schedule's shape rather than walked (a large search asks for hundreds of shapes).

    `interleaved_1f1b`'s rank r runs T = M v forwards, the k-th on chunk (k mod pv) // p
    and its k-th backward on the chunk mirrored, v - 1 - that; it warms up with W of the
    forwards, then follows each forward with the next backward.  Of the first n forwards,
    F_c(n) = (n // pv) p + clamp(n mod pv - c p, 0, p) are on chunk c, so chunk c holds
    F_c(W) after the warm-up, and F_c(W + 1 + j) - F_(v-1-c)(j) after the (W + j)-th
    forward.  That difference repeats with period pv in j and changes slope only where one
    of its terms enters or leaves its chunk's run of p, so its most lies at one of those
    points or at an end of the first period (tests walk the schedule itself)."""
    p, v, total = ranks, virtual_stages, microbatches * virtual_stages
    group = p * v

    def forwards(c: int, n: int) -> int:
        return (n // group) * p + min(max(n % group - c * p, 0), p)

    peaks = [0] * group
    for r in range(p):
        warmup = interleaved_warmup(p, v, microbatches, r)
        span = min(group, total - warmup)  # one period of the steady state, or all of it
        for c in range(v):
            mirror = v - 1 - c
            turns = {0, span - 1} | {j % group for j in (c * p - warmup - 1, (c + 1) * p - warmup - 1,
                                                          mirror * p, (mirror + 1) * p)}
            steady = (forwards(c, warmup + 1 + j) - forwards(mirror, j) for j in turns if 0 <= j < span)
            peaks[c * p + r] = max([forwards(c, warmup), *steady])
    return tuple(peaks)


def _one_per_rank(builder: Callable[[int, int], Schedule]) -> Builder:
    """A builder of (ranks, microbatches) as a registry `Builder` (stages per rank checked by `make`)."""
    def build(ranks: int, microbatches: int, virtual_stages: int) -> Schedule:
        return builder(ranks, microbatches)
    return build


def _interleaved(ranks: int, microbatches: int, virtual_stages: int) -> Schedule:
    return interleaved_1f1b(ranks, virtual_stages, microbatches)


_SPECS = (
    ScheduleSpec("gpipe", _one_per_rank(gpipe), 1, False, _every_microbatch, auto=True),
    ScheduleSpec("1f1b", _one_per_rank(one_f_one_b), 1, False, _warmup, auto=True),
    # not for auto: its stages per rank are the user's choice (--virtual-stages)
    ScheduleSpec("interleaved", _interleaved, None, False, _interleaved_peak, auto=False, microbatches_per_rank=True),
    ScheduleSpec("zb-h1", _one_per_rank(zb_h1), 1, True, _first_stage_peak, auto=True, awaiting_w_of=_one_w_per_stage),
    ScheduleSpec("zb-h2", _one_per_rank(zb_h2), 1, True, _twice_first_stage_peak, auto=True,
                 awaiting_w_of=_two_w_per_stage),
    ScheduleSpec("zb-v", _one_per_rank(zb_v), 2, True, _warmup, auto=True, vee=True, awaiting_w_of=_down_and_up_the_vee),
)
#: every schedule by name, in the order the command line lists them
REGISTRY: dict[str, ScheduleSpec] = {s.name: s for s in _SPECS}
#: the names a package may carry in its manifest
SCHEDULES: tuple[str, ...] = tuple(REGISTRY)
#: what `--schedule auto` tries
AUTO_SCHEDULES: tuple[str, ...] = tuple(s.name for s in _SPECS if s.auto)
#: the schedule of a package compiled without --schedule or --devices (docs/command-line.md)
DEFAULT_SCHEDULE = "1f1b"


def schedule_spec(name: str) -> ScheduleSpec:
    """The spec of schedule `name`; an `UnknownScheduleError` that lists the registry if none."""
    found = REGISTRY.get(name)
    if found is None:
        raise UnknownScheduleError(f"unknown schedule {name!r}: use {names()}.")
    return found


def names(last: str = "or") -> str:
    """The registry's names as a sentence: "gpipe, 1f1b, ... or zb-v"."""
    return f"{', '.join(SCHEDULES[:-1])} {last} {SCHEDULES[-1]}"


def placement(schedule: str, num_stages: int, ranks: int) -> tuple[int, ...]:
    """The pipeline rank of each stage: s % ranks, or a V under zb-v ([Note: V placement])."""
    return schedule_spec(schedule).placement(num_stages, ranks)


def make_schedule(name: str, ranks: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The compute schedule a manifest names (one of SCHEDULES)."""
    return schedule_spec(name).make(ranks, microbatches, virtual_stages)


def _count(n: int) -> str:
    return {1: "one", 2: "two"}.get(n, str(n))
