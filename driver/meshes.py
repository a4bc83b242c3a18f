"""The meshes `--devices N` searches (driver/search.py, step 1): every factorisation of N
into pipeline stages, tensor-parallel ranks and data-parallel replicas that the options
leave open, the microbatch counts, schedules and ZeRO stages each is tried with, and the
error when none fits."""

from __future__ import annotations

import math

from runtime.schedule import registry

from partitioner.cost.hardware import Hardware

from .options import AUTO, CompileOptions
from .ranking import Candidate

__all__ = ["AUTO_SCHEDULES", "INTERLEAVED", "interleaved_schedule", "meshes", "microbatch_multiple", "nothing_fits",
           "schedules", "tp_limit", "zeros"]

#: what `--schedule auto` tries: the registry's schedules marked `auto` (interleaved is left
#: out: its stage count is its own choice); zb-v splits the model in 2 stages per rank, each
#: rank's two held to its memory together
AUTO_SCHEDULES = registry.AUTO_SCHEDULES
INTERLEAVED = "interleaved"


def meshes(devices: int, batch: int, opts: CompileOptions, tp_limit: int | None = None) -> list[tuple[int, int, int, int]]:
    """(pp, tp, dp, microbatches) to try, in a fixed order: every factorisation of the
    devices that the options leave open, tp dividing `tp_limit` (when given), with 1, 2
    and 4 microbatches per stage and one row per microbatch."""
    out = []
    for tp in _divisors(devices):
        if opts.tp is not None and tp != opts.tp:
            continue
        if opts.tp is None and tp_limit is not None and tp_limit % tp:
            continue
        for dp in _divisors(devices // tp):
            if opts.dp != 1 and dp != opts.dp:
                continue
            pp = devices // (tp * dp)
            if opts.stages is not None and pp != opts.stages:
                continue
            counts = [opts.microbatches] if opts.microbatches else sorted({pp, 2 * pp, 4 * pp, batch // dp})
            for m in counts:
                if m > 0 and batch % (m * dp) == 0 and m % microbatch_multiple(opts.schedule, pp) == 0:
                    out.append((pp, tp, dp, m))
    return out


def nothing_fits(opts: CompileOptions, failed: list[Candidate]) -> str:
    """The error of a search whose every mesh exceeds --memory: the first few, and the fixes."""
    notes = "; ".join(f"pp={c.pp} tp={c.tp} dp={c.dp} M={c.microbatches} {c.schedule}: {c.note}" for c in failed[:4])
    unsharded = opts.zero == 0 and any(c.dp > 1 for c in failed)
    return (f"no mesh of {opts.devices} devices fits --memory ({notes}): raise --memory or add devices"
            + (", or drop --zero 0 so that a mesh with data-parallel replicas may shard its optimizer state "
               "across them (ZeRO-1)." if unsharded else "."))


def schedules(schedule: str, pp: int) -> tuple[str, ...]:
    """The schedules a mesh of `pp` stages is tried with: the one asked for, or under
    auto each of AUTO_SCHEDULES (the zero-bubble ones only where there is a pipeline)."""
    if schedule != AUTO:
        return (schedule,)
    return tuple(s for s in AUTO_SCHEDULES if pp > 1 or not registry.schedule_spec(s).splits_backward)


def interleaved_schedule(opts: CompileOptions, pp: int, microbatches: int, rows: int) -> tuple[str, ...]:
    """Interleaved 1F1B under auto, its stages per rank searched (`solve_interleaved`): where
    there is a pipeline, one row per microbatch (Megatron-LM's recipe, microbatch 1) and
    the microbatches a multiple of the ranks; left out elsewhere to keep the search short."""
    spec = registry.schedule_spec(INTERLEAVED)
    wanted = opts.schedule == AUTO and pp > 1 and rows == 1 and microbatches % spec.microbatch_multiple(pp) == 0
    return (INTERLEAVED,) if wanted else ()


def microbatch_multiple(schedule: str, pp: int) -> int:
    """What a microbatch count must be a multiple of under `schedule` (under auto, under
    every schedule it tries) on `pp` ranks."""
    return math.lcm(*(registry.schedule_spec(s).microbatch_multiple(pp) for s in schedules(schedule, pp)))


def zeros(opts: CompileOptions, dp: int) -> tuple[int, ...]:
    """The ZeRO stages a mesh of `dp` replicas is tried with: the one asked for, or 0
    and, where there are replicas to shard across, 1."""
    if opts.zero is not None:
        return (opts.zero,)
    return (0, 1) if dp > 1 else (0,)


def tp_limit(hardware: Hardware) -> int | None:
    """The devices of one node, which tensor-parallel groups stay inside (None: no limit,
    for a profile of one device per node, such as this machine's CPU)."""
    return hardware.devices_per_node if hardware.devices_per_node > 1 else None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
