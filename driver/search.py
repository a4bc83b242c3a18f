"""`--devices N`: search the meshes stages x tp x dp = N and the microbatch count.

    1. meshes:   every factorisation of N into pipeline stages, tensor-parallel ranks and
                 data-parallel replicas that the options leave open, with tp inside one
                 node of the hardware profile (as Megatron-LM places it: its collectives
                 need the node's links); with 1, 2 and 4 microbatches per stage, and one
                 row per microbatch (the most microbatches: the least pipeline bubble);
    2. prepare:  the model is built once, traced and costed once per microbatch shape,
                 split for tensor parallelism once per (shape, tp) and coarsened once
                 per split (`_Shapes`);
    3. solve:    each candidate's problem is posed and solved; one that does not fit
                 memory (the solver's bound, then the peak walked over the schedule:
                 driver/memory.py) is solved again with ZeRO-1 (where dp > 1 and --zero
                 was not given), with offloading (--offload auto) and with selective,
                 then full recomputation (--recompute auto), then with several: every
                 cheapest variant that fits is a candidate (`offloading.variants`);
    4. simulate: candidates in order of a lower bound on their step, until the bound
                 passes the SHOWN-th best step found ([Note: the search's bounds]);
    5. emit the best; the best SHOWN are recorded in the manifest for `show`.

[Note: the search's bounds]
    Every candidate is solved (the DPs make that cheap), then simulated in order of a
    lower bound on its step (`_bound`: the busiest rank's compute, fill and drain) until
    the bound passes the SHOWN-th best step found: the SHOWN fastest are those simulating
    every candidate would rank.  Bars on stderr show the candidates solved and simulated.

With `--schedule auto` every mesh is also tried under each schedule of AUTO_SCHEDULES (the
zero-bubble ones only with 2 stages or more), each with its own memory: the fastest that fits wins.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass
from typing import Any, Callable

from runtime.schedule import registry

from partitioner.cost.hardware import Hardware, load_hardware
from partitioner.cost.roofline import BACKWARD_FLOP_FACTOR, mfu
from partitioner.errors import InfeasiblePlanError, PlanError
from partitioner.ir import Plan, SolverReport
from partitioner.predict.predict import mfu_peak, simulate_plan
from partitioner.solve.problem import coarse_graph, pose
from partitioner.solve.model import interleaved
from partitioner.solve.solve import solve
from partitioner.trace.checkpointing import describe

from .memory import rank_peaks
from .options import AUTO, CompileOptions, mesh_of, stages_per_rank
from . import offloading
from .package_info import model_flops
from .phases import apply_tp, choose_split, finish, load_source, prepare
from .prepared import Compiled, Prepared, Source
from .recompute import LEVELS, planned, with_policy

__all__ = ["Candidate", "search"]

SHOWN = 5
#: what `--schedule auto` tries: the registry's schedules marked `auto` (interleaved is left
#: out: its stage count is its own choice); zb-v splits the model in 2 stages per rank, each
#: rank's two held to its memory together
AUTO_SCHEDULES = registry.AUTO_SCHEDULES
#: a bound this close to a step time still gets simulated (float sums in another order)
_BOUND_SLACK = 1e-9


@dataclass(frozen=True)
class Candidate:
    """One mesh and microbatch count, and what the simulator predicts for it."""

    pp: int
    dp: int
    tp: int
    microbatches: int
    step_time_s: float = float("inf")
    memory_bytes: int = 0
    mfu: float = 0.0
    fits: bool = True
    note: str = ""
    recompute: str | None = None  # the uniform policy solved ([Note: recomputation chosen per rank])
    schedule: str = ""
    zero: int = 0
    offload: bool = False  # activations offloaded where the mesh binds ([Note: offloaded activations])


@dataclass
class _Solved:
    """A candidate solved but not yet simulated."""

    cand: Candidate
    prepared: Prepared
    assignment: tuple[int, ...]
    report: SolverReport
    plan: Plan
    bound_s: float


def search(opts: CompileOptions, say: Callable[[str], None], source: Source | None = None) -> Compiled:
    """Compile the best mesh for `opts.devices` devices into `opts.out` (`source`: loaded)."""
    assert opts.devices is not None
    hardware = load_hardware(opts.hardware)
    source = source or load_source(opts, say)
    meshes = _meshes(opts.devices, source.batch, opts, _tp_limit(hardware))
    if not meshes:
        raise PlanError(f"no mesh stages x tp x dp = {opts.devices} devices suits the options and a batch of "
                        f"{source.batch} rows: change --devices, or drop --stages/--tp/--dp to let the search choose.")
    say(f"searching {len(meshes)} meshes of {opts.devices} devices (stages x tp x dp, microbatches)")
    shapes = _Shapes(source)
    posed = _posed(meshes, opts, shapes, source.batch)
    failed: list[Candidate] = []
    solved: list[_Solved] = []
    with _progress(opts, len(posed), "solving") as bar:
        for sub, base, pp, m in posed:
            found = _solve(base, sub, pp, m, _zeros(opts, sub.dp))
            if isinstance(found, Candidate):
                failed.append(found)
            elif found is not None:
                solved.extend(found)
            bar.update(1)
    ranking = _Ranking(opts.devices, say)
    with _progress(opts, len(solved), "simulating") as bar:
        ranking.add(solved, bar)  # [Note: the search's bounds]
    if ranking.skipped:
        say(f"  {ranking.skipped} candidates skipped: a lower bound on their step (the busiest rank's compute, "
            f"pipeline fill and drain) exceeds the {SHOWN}th best")
    ranked = ranking.ranked
    if not ranked:
        raise InfeasiblePlanError(_nothing_fits(opts, failed))
    best, win = ranked[0]
    say(f"best mesh: pp={best.pp} tp={best.tp} dp={best.dp}, {best.microbatches} microbatches, {best.schedule}"
        + (f", recomputation {best.recompute}" if best.recompute else "") + (", ZeRO-1" if best.zero else "")
        + (", activations offloaded" if best.offload else ""))
    _say_checkpointing(win.prepared.traced.checkpointed, bool(best.recompute), say)
    shown = [dataclasses.asdict(c) for c, _ in ranked[:SHOWN]]
    return finish(win.prepared, win.assignment, win.report, extra={"candidates": shown})


def _posed(meshes: list[tuple[int, int, int, int]], opts: CompileOptions, shapes: "_Shapes", batch: int
           ) -> list[tuple[CompileOptions, Prepared, int, int]]:
    """(options, split model, pp, microbatches) of every mesh and schedule to solve; a tp
    degree that splits nothing is left out."""
    out = []
    for pp, tp, dp, m in meshes:
        for schedule in _schedules(opts.schedule, pp):
            sub = dataclasses.replace(opts, devices=None, stages=pp, tp=tp, dp=dp, microbatches=m, quiet=True,
                                      schedule=schedule)
            base = shapes.split(sub, batch // (m * dp), tp)
            if base is None:
                break  # the solver split nothing: tp ranks would only repeat each other's work
            out.append((sub, base, pp, m))
    return out


def _progress(opts: CompileOptions, total: int, doing: str) -> Any:
    """A bar on stderr: candidates done of total, the best so far, the time left; silent with --quiet."""
    from tqdm import tqdm
    return tqdm(total=total, desc=doing, unit="candidate", disable=opts.quiet, file=sys.stderr, leave=False,
                dynamic_ncols=True)


def _say_checkpointing(regions: tuple[str, ...], recompute: bool, say: Callable[[str], None]) -> None:
    """One line where the model checkpoints regions itself: the search's recompute choice
    replaces that ([Note: the user's checkpointing] in partitioner/trace/checkpointing.py)."""
    if regions:
        say(f"the model's own gradient checkpointing (torch.utils.checkpoint around {describe(regions)}) is traced as "
            f"the ops it runs and replaced by the planner's recompute choice: activations "
            f"{'recomputed' if recompute else 'kept, since the mesh fits without recomputing'} (--recompute forces "
            f"recomputation)")


# -- 1. meshes ---------------------------------------------------------------------------------


def _meshes(devices: int, batch: int, opts: CompileOptions, tp_limit: int | None = None) -> list[tuple[int, int, int, int]]:
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
                if m > 0 and batch % (m * dp) == 0 and m % _microbatch_multiple(opts.schedule, pp) == 0:
                    out.append((pp, tp, dp, m))
    return out


def _nothing_fits(opts: CompileOptions, failed: list[Candidate]) -> str:
    """The error of a search whose every mesh exceeds --memory: the first few, and the fixes."""
    notes = "; ".join(f"pp={c.pp} tp={c.tp} dp={c.dp} M={c.microbatches} {c.schedule}: {c.note}" for c in failed[:4])
    unsharded = opts.zero == 0 and any(c.dp > 1 for c in failed)
    return (f"no mesh of {opts.devices} devices fits --memory ({notes}): raise --memory or add devices"
            + (", or drop --zero 0 so that a mesh with data-parallel replicas may shard its optimizer state "
               "across them (ZeRO-1)." if unsharded else "."))


def _schedules(schedule: str, pp: int) -> tuple[str, ...]:
    """The schedules a mesh of `pp` stages is tried with: the one asked for, or under
    auto each of AUTO_SCHEDULES (the zero-bubble ones only where there is a pipeline)."""
    if schedule != AUTO:
        return (schedule,)
    return tuple(s for s in AUTO_SCHEDULES if pp > 1 or not registry.schedule_spec(s).splits_backward)


def _microbatch_multiple(schedule: str, pp: int) -> int:
    """What a microbatch count must be a multiple of under `schedule` (under auto, under
    every schedule it tries) on `pp` ranks."""
    return math.lcm(*(registry.schedule_spec(s).microbatch_multiple(pp) for s in _schedules(schedule, pp)))


def _zeros(opts: CompileOptions, dp: int) -> tuple[int, ...]:
    """The ZeRO stages a mesh of `dp` replicas is tried with: the one asked for, or 0
    and, where there are replicas to shard across, 1."""
    if opts.zero is not None:
        return (opts.zero,)
    return (0, 1) if dp > 1 else (0,)


def _tp_limit(hardware: Hardware) -> int | None:
    """The devices of one node, which tensor-parallel groups stay inside (None: no limit,
    for a profile of one device per node, such as this machine's CPU)."""
    return hardware.devices_per_node if hardware.devices_per_node > 1 else None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# -- 2. prepare, once per shape and split -------------------------------------------------------------


class _Shapes:
    """The model traced and costed once per microbatch shape (rows), split once per
    (rows, tp), each split coarsened once."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self.whole: dict[int, Prepared] = {}
        self.splits: dict[tuple[int, int], Prepared | None] = {}

    def split(self, opts: CompileOptions, rows: int, tp: int) -> Prepared | None:
        """The model at `rows` rows per microbatch split for `tp` ranks (None when the
        split leaves every node whole)."""
        if rows not in self.whole:
            self.whole[rows] = prepare(dataclasses.replace(opts, tp=1), source=self.source)
        if (rows, tp) not in self.splits:
            self.splits[(rows, tp)] = _split(self.whole[rows], opts, tp)
        return self.splits[(rows, tp)]


def _split(base: Prepared, opts: CompileOptions, tp: int) -> Prepared | None:
    """`base` (tp = 1) split for `tp` tensor-parallel ranks, coarsened."""
    if tp == 1:
        return base
    traced, costs, sharded = apply_tp(base.traced, base.costs, tp, base.hardware, opts)
    if sharded is None or not sharded.rules:
        return None
    return dataclasses.replace(base, opts=opts, traced=traced, costs=costs, sharded=sharded,
                               whole=(base.traced, base.costs), coarse=coarse_graph(traced, costs, sharded, base.loss))


# -- 3. solve ------------------------------------------------------------------------------------------


def _solve(base: Prepared, opts: CompileOptions, pp: int, microbatches: int,
           zeros: tuple[int, ...]) -> list[_Solved] | Candidate | None:
    """The candidate solved in each cheapest variant that fits (`offloading.variants`); a Candidate
    that fits in none; None when the stage count cannot be filled."""
    found: list[_Solved] = []
    note = ""
    for zero, recompute, offload in offloading.variants(opts, zeros):
        if any(f.cand.zero <= zero and LEVELS.index(f.cand.recompute) <= LEVELS.index(recompute)
               and f.cand.offload <= offload for f in found):
            continue  # a variant that costs no more in any respect fits already
        sub = dataclasses.replace(opts, zero=zero)
        prepared = with_policy(_repose(base, sub, pp, microbatches, offload), recompute)
        try:
            assignment, report = solve(prepared.problem, time_limit_s=min(sub.time_limit, 5.0), explain=False)
        except InfeasiblePlanError as exc:
            note = note or str(exc)
            continue
        except PlanError:
            return None
        if interleaved(prepared.problem):  # [Note: splits chosen by the simulator]
            _, assignment, report = choose_split(prepared, assignment, report)
        plan = planned(prepared, assignment, report)  # [Note: recomputation chosen per rank]
        plan = offloading.offload(prepared, plan)[0]  # the copies' time, for the simulator
        peak = max(rank_peaks(prepared, plan))  # walked over the schedule, as the manifest says
        if peak > (prepared.problem.memory_limit_bytes or peak):  # the solver's bound fits, the walk does not
            continue
        cand = Candidate(pp, opts.dp, opts.tp or 1, microbatches, memory_bytes=peak,
                         recompute=recompute, schedule=opts.schedule, zero=plan.zero, offload=bool(plan.offload))
        found.append(_Solved(cand, prepared, assignment, report, plan, _bound(prepared, assignment, plan)))
    return found or Candidate(pp, opts.dp, opts.tp or 1, microbatches, fits=False, note=note, schedule=opts.schedule)


def _repose(base: Prepared, opts: CompileOptions, pp: int, microbatches: int, offload: bool = False) -> Prepared:
    """`base` posed for another stage and microbatch count (same trace, costs, blocks), `offload`ing or not."""
    assert base.coarse is not None
    mesh = dataclasses.replace(mesh_of(opts, pp, stages_per_rank(opts), microbatches), offload=offload)
    problem = pose(base.coarse, mesh, base.hardware)
    return dataclasses.replace(base, opts=opts, problem=problem, blocks=base.coarse.blocks, mesh=mesh,
                               rows=base.batch // (microbatches * opts.dp))


def _bound(prepared: Prepared, assignment: tuple[int, ...], plan: Plan) -> float:
    """A step no shorter than the simulator's: the most, over pipeline ranks r, of

        forward of microbatch 0 along the longest path of stages into stage r
        + every microbatch's forward and backward of every stage on rank r
        + backward of the last microbatch along the longest path out of stage r

    (rank r starts with stage r's first forward and ends with its last backward in
    every schedule; links, the loss and the data-parallel all-reduce only add).  For
    equal stages and free links it is (M + S - 1) x stage time, the step itself.  Under a
    zero-bubble schedule a rank's last action may be a W that waits for nobody: the
    backward path out is left out there."""
    costs = prepared.costs
    forward = [sum(costs[n].forward_s for n in s.nodes) for s in plan.stages]
    backward = [s.compute_s - f for s, f in zip(plan.stages, forward)]  # recomputation included
    producers: dict[int, set[int]] = {k: set() for k in range(plan.num_stages)}
    for e in prepared.problem.edges:
        a, b = assignment[e.src], assignment[e.dst]
        if a != b:
            producers[b].add(a)
    into, out = [0.0] * plan.num_stages, [0.0] * plan.num_stages  # stages are numbered in a topological order
    for k in range(plan.num_stages):
        into[k] = max((into[p] + forward[p] for p in producers[k]), default=0.0)
        out[k] = max((backward[p] + out[p] for p in producers[k]), default=0.0)
    work = [0.0] * plan.pp
    for s in plan.stages:
        work[plan.rank_of(s.index)] += s.compute_s
    if plan.spec.splits_backward:
        out = [0.0] * plan.num_stages
    return max(into[r] + plan.microbatches * work[r] + out[r] for r in range(plan.pp)) * (1 - _BOUND_SLACK)


# -- 4. simulate -----------------------------------------------------------------------------------------


class _Ranking:
    """The candidates simulated so far, fastest first: each is simulated unless its bound
    shows that it cannot be among the SHOWN fastest ([Note: the search's bounds])."""

    def __init__(self, devices: int, say: Callable[[str], None]) -> None:
        self.devices, self.say = devices, say
        self.ranked: list[tuple[Candidate, _Solved]] = []
        self.skipped = 0

    def beaten(self, bound_s: float) -> bool:
        """Whether a candidate of step at least `bound_s` cannot be among the SHOWN fastest."""
        return len(self.ranked) >= SHOWN and bound_s > self.ranked[SHOWN - 1][0].step_time_s

    def add(self, solved: list[_Solved], bar: Any) -> None:
        """Simulate each of `solved` (in order of bound) that may be among the SHOWN fastest,
        showing on `bar` how many are done and the best so far."""
        for item in sorted(solved, key=lambda x: x.bound_s):  # sorted is stable: mesh order breaks ties
            bar.update(1)
            if self.beaten(item.bound_s):
                self.skipped += 1
                continue
            cand = _simulated(item, self.devices)
            self.ranked.append((cand, item))
            self.ranked.sort(key=lambda r: (r[0].step_time_s, r[0].tp, r[0].pp, r[0].microbatches, LEVELS.index(r[0].recompute),
                                            r[0].zero))
            c = item.cand
            self.say(f"  mesh pp={c.pp} tp={c.tp} dp={c.dp} M={c.microbatches} {c.schedule}"
                     f"{' recompute ' + c.recompute if c.recompute else ''}{' zero-1' if c.zero else ''}: "
                     f"{cand.step_time_s * 1e3:.3f} ms, MFU {cand.mfu * 100:.1f}%")
            bar.set_postfix_str(self.best_text(), refresh=False)

    def best_text(self) -> str:
        """The best so far, for the progress bar."""
        c = self.ranked[0][0] if self.ranked else None
        return "best: none yet" if c is None else f"best {c.step_time_s * 1e3:.1f} ms pp{c.pp} tp{c.tp} dp{c.dp} M{c.microbatches} {c.schedule}"


def _simulated(item: _Solved, devices: int) -> Candidate:
    """`item`'s candidate with the simulator's step and MFU."""
    p, c = item.prepared, item.cand
    sim = simulate_plan(p.traced.gm, item.plan, p.costs, p.hardware, p.loss)
    flops = model_flops(p) * (1 + BACKWARD_FLOP_FACTOR) * c.microbatches * c.dp
    peak = mfu_peak(p.traced.gm, p.costs, p.hardware, p.opts.precision)[1]  # [Note: a peak per dtype]
    return dataclasses.replace(c, step_time_s=sim.step_time_s, mfu=mfu(flops, sim.step_time_s, devices, peak))
