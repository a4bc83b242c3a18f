"""`--devices N`: search the meshes stages x tp x dp = N and the microbatch count.

    1. meshes:   every factorisation of N into pipeline stages, tensor-parallel ranks and
                 data-parallel replicas that the options leave open, with tp inside one
                 node of the hardware profile (as Megatron-LM places it: its collectives
                 need the node's links); with 1, 2 and 4 microbatches per stage, and one
                 row per microbatch (the most microbatches: the least pipeline bubble);
    2. prepare:  the model is built once, traced and costed once per microbatch shape,
                 split for tensor parallelism once per (shape, tp) and coarsened once
                 per split (`_Shapes`);
    3. solve:    each candidate's partition problem is posed and solved, in order of a
                 floor under its step; one that does not fit memory (the solver's
                 bound, then the peak walked over the schedule: driver/memory.py) is
                 solved again with ZeRO-1 (where dp > 1 and --zero was not given), with
                 offloading (--offload auto) and, under --recompute auto, with the split
                 and each stage's policy chosen together (one stage per rank), else with
                 selective, then full recomputation, then with several: every cheapest variant that fits
                 is a candidate (`offloading.variants`; a variant whose policy fits
                 nothing with ZeRO-1 and offloading is refused unsolved: [Note: the
                 leanest variant first]).  Solved by the exact DPs over contiguous plans
                 alone (`_solve_one`);
    4. simulate: each solved candidate, unless its bound shows it cannot be the fastest
                 ([Note: the search's bounds]); steps 3 and 4 in worker processes, one
                 per core, on a large search, the first microbatch shape's candidates
                 in one while the others are prepared ([Note: the search in worker
                 processes] in driver/workers.py);
    5. emit the best; the best SHOWN are recorded in the manifest for `show`.

[Note: the search's bounds]
    Lower bounds on the simulated step prune the search (driver/ranking.py): `floor`,
    known once a candidate is posed (every microbatch's compute spread evenly over the
    ranks, or as whole blocks: with one stage per rank the slowest run of the most even
    split of the blocks, else the least some rank must hold of them; and the least of
    what follows the walk: the loss's all-reduce, ZeRO-1's broadcast, the all-reduce the
    backward cannot hide), `bound` once it is solved (the busiest rank's compute,
    pipeline fill and drain), and `step_bound`, the same from the simulator's own
    inputs, with the loss and what follows the walk (for a split that offloads, again
    once its shares are known, with the time its copies add).  Candidates are taken in
    order of floor; one whose floor passes the best step simulated so far is skipped
    unsolved, and so is a memory variant whose own floor passes it (a forward run again
    under recomputation, ZeRO-1's broadcast); a solved split whose bound passes it is
    neither walked ([Note: walked only where it matters]) nor simulated.  A DP is given
    the best step, less `after_floor`, over M as a cap on a rank's compute per microbatch
    ([Note: a cap on a rank's compute] in partitioner/solve/solve.py): it returns the
    split it would return without the cap, or refuses where that split, like every
    other, is beaten; a variant so refused is solved again without the cap only where
    it must say whether it fits, to cover a costlier one that is not beaten.
    A variant whose weights, gradients and optimizer state alone exceed the memory of
    its ranks is refused before its DP runs (partitioner/solve/solve.py).  No bound
    exceeds a step, so the fastest is the one solving and simulating every candidate
    would find; `show` lists the fastest of those simulated.  A bar on stderr shows the
    candidates done of their total, the time left, and the best so far.

With `--schedule auto` every mesh is also tried under each schedule of AUTO_SCHEDULES
(the zero-bubble ones only with 2 stages or more), each posed with its own memory (ZB-H2
holds twice the microbatches; ZB-V splits the model in two stages per rank), and under
interleaved 1F1B where a microbatch is one row (`interleaved_schedule`), so the fastest predicted
schedule that fits wins.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any, Callable, Iterator, NamedTuple

from runtime.schedule import registry

from partitioner.cost.hardware import load_hardware
from partitioner.errors import BeyondCapError, InfeasiblePlanError, PlanError
from partitioner.ir import Plan, SolverReport
from partitioner.predict.step import StepInputs
from partitioner.solve.problem import coarse_graph, pose
from partitioner.solve.model import interleaved
from partitioner.solve.solve import even_split, objective, solve
from partitioner.trace.checkpointing import describe

from . import offloading
from .memory import rank_peaks
from .meshes import interleaved_schedule, meshes, nothing_fits, schedules, tp_limit, zeros
from .options import CompileOptions, mesh_of, stages_per_rank
from .phases import apply_tp, finish, load_source, prepare, virtual_counts
from .prepared import Compiled, Prepared, Source
from .ranking import SHOWN, Beaten, Candidate, Ranking, Solved, after_floor, bound, floor, step_bound
from .recompute import AUTO as MIXED, joins, plan_policy, planned, solve_jointly, variant_rank, with_policy
from .workers import Early, Solve, outcomes, workers

__all__ = ["Candidate", "search"]


def search(opts: CompileOptions, say: Callable[[str], None], source: Source | None = None) -> Compiled:
    """Compile the best mesh for `opts.devices` devices into `opts.out` (`source`: loaded)."""
    assert opts.devices is not None
    hardware = load_hardware(opts.hardware)
    source = source or load_source(opts, say)
    found = meshes(opts.devices, source.batch, opts, tp_limit(hardware))
    if not found:
        raise PlanError(f"no mesh stages x tp x dp = {opts.devices} devices suits the options and a batch of "
                        f"{source.batch} rows: change --devices, or drop --stages/--tp/--dp to let the search choose.")
    say(f"searching {len(found)} meshes of {opts.devices} devices (stages x tp x dp, microbatches)")
    ranking = Ranking(opts.devices, say)
    failed = _rank(_posing(found, opts, _Shapes(source), source.batch), opts, ranking)
    if ranking.skipped:
        say(f"  {ranking.skipped} candidates skipped: a lower bound on their step (the busiest rank's compute, "
            f"pipeline fill and drain) exceeds the best step found")
    ranked = ranking.ranked
    if not ranked:
        raise InfeasiblePlanError(nothing_fits(opts, failed))
    best, win = ranked[0]
    virtual = f" x{best.virtual_stages}" if best.schedule == "interleaved" else ""
    say(f"best mesh: pp={best.pp} tp={best.tp} dp={best.dp}, {best.microbatches} microbatches, {best.schedule}{virtual}"
        + (f", recomputation {best.recompute}" if best.recompute else "") + (", ZeRO-1" if best.zero else "")
        + (", activations offloaded" if best.offload else ""))
    _say_checkpointing(win.prepared.traced.checkpointed, bool(best.recompute), say)
    shown = [dataclasses.asdict(c) for c, _ in ranked[:SHOWN]]
    return finish(win.prepared, win.assignment, win.report, extra={"candidates": shown})


class _Posed(NamedTuple):
    """One mesh, microbatch count and schedule to solve, and a floor under its step."""

    opts: CompileOptions
    base: Prepared
    pp: int
    microbatches: int
    floor_s: float
    seq: tuple[int, int]  # its mesh's place in `meshes` and its own in the mesh's: ties of `_order` keep it


def _posing(meshes: list[tuple[int, int, int, int]], opts: CompileOptions, shapes: "_Shapes", batch: int
            ) -> Iterator[list[_Posed]]:
    """Every mesh and schedule to solve (`_posed`), a microbatch shape at a time, in the order
    `meshes` first comes to each (the shapes are prepared in that order, as they always
    were; at a thousand GPUs and more the first is one row per microbatch, the most
    microbatches, where most candidates and mostly the best step lie)."""
    by_rows: dict[int, list[int]] = {}
    for i, (_pp, _tp, dp, m) in enumerate(meshes):
        by_rows.setdefault(batch // (m * dp), []).append(i)
    for indices in by_rows.values():
        yield [item for i in indices for item in _posed(i, meshes[i], opts, shapes, batch)]


def _posed(i: int, mesh: tuple[int, int, int, int], opts: CompileOptions, shapes: "_Shapes", batch: int
           ) -> list[_Posed]:
    """Mesh `i`'s candidates, each schedule (and stages per rank) with `floor` of its problem;
    none where its tp degree splits nothing."""
    pp, tp, dp, m = mesh
    out: list[_Posed] = []
    for schedule in schedules(opts.schedule, pp) + interleaved_schedule(opts, pp, m, batch // (m * dp)):
        sub = dataclasses.replace(opts, devices=None, stages=pp, tp=tp, dp=dp, microbatches=m, quiet=True,
                                  schedule=schedule)
        base = shapes.split(sub, batch // (m * dp), tp)
        if base is None:
            break  # the solver split nothing: tp ranks would only repeat each other's work
        for v in _virtual(sub, pp, base):
            each = dataclasses.replace(sub, virtual_stages=v) if v else sub
            out.append(_Posed(each, base, pp, m, floor(_repose(base, each, pp, m)), (i, len(out))))
    return out


def _virtual(opts: CompileOptions, pp: int, base: Prepared) -> tuple[int | None, ...]:
    """The stages per rank to pose: under interleaved 1F1B each count `virtual_counts` tries
    (the layers per stage a consequence of the split), else the schedule's own (None)."""
    if registry.schedule_spec(opts.schedule).stages_per_rank is not None:
        return (None,)
    assert base.coarse is not None
    return virtual_counts(opts.virtual_stages, pp, len(base.coarse.blocks))


def _order(item: "_Posed") -> tuple[float, tuple[int, int]]:
    """The order candidates are tried in: the floor, times a 1F1B bubble of (pp - 1) / (M v),
    so that a good step is found early and prunes the rest (any order ranks the same); then
    the order of `meshes`."""
    v = item.opts.virtual_stages or 1
    return item.floor_s * (1 + (item.pp - 1) / (item.microbatches * v)), item.seq


def _rank(posing: Iterator[list[_Posed]], opts: CompileOptions, ranking: Ranking) -> list[Candidate]:
    """Solve and simulate each candidate `posing` yields (in order of floor) that may be the
    fastest into `ranking` ([Note: the search's bounds]), in worker processes where that
    helps, the first shape's starting while the rest are posed ([Note: the search in worker
    processes] in driver/workers.py); the candidates that fit nowhere."""

    def solving(items: list[_Posed]) -> Solve:
        def solve(index: int, beaten: Beaten) -> list[Solved] | Candidate | None:
            item = items[index]
            if beaten(item.floor_s):
                return None
            found = _solve(item.base, item.opts, item.pp, item.microbatches, zeros(opts, item.opts.dp), beaten)
            return [] if found is None else found
        return solve

    first = sorted(next(posing, []), key=_order)
    early = Early([item.base for item in first], solving(first), ranking) if workers(len(first)) > 1 else None
    try:
        posed = sorted(first + [item for shape in posing for item in shape], key=_order)
        if early is not None:
            local = {id(item): i for i, item in enumerate(first)}
            early.place([local.get(id(item), -1) for item in posed])
        failed: list[Candidate] = []
        with _progress(opts, len(posed), "meshes") as bar:
            for outcome in outcomes([item.base for item in posed], solving(posed), ranking, workers(len(posed)),
                                    early):
                bar.update(1)
                for cand, item in outcome.simulated:
                    ranking.insert(cand, item, outcome.order)
                failed += [outcome.failed] if outcome.failed else []
                ranking.skipped += outcome.skipped
                bar.set_postfix_str(ranking.best_text(), refresh=False)
        return failed
    finally:
        if early is not None:
            early.close()


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


def _solve(base: Prepared, opts: CompileOptions, pp: int, microbatches: int, zeros: tuple[int, ...],
           beaten: Beaten) -> list[Solved] | Candidate | None:
    """The candidate solved in each cheapest variant that fits (`offloading.variants`), less
    those whose bound is `beaten`; a Candidate that fits in none; None when the stage count
    cannot be filled.  A split's peak is walked only where it matters ([Note: walked only
    where it matters]); a DP leaves out what computes over the best step found ([Note: a
    cap on a rank's compute] in partitioner/solve/solve.py)."""
    tried: list[_Tried] = []
    capped: list[_Variant] = []  # beaten under the cap: whether they fit is not known
    note = ""
    solves = _Solves(base, opts, pp, microbatches, offloading.variants(opts, zeros))
    for variant in solves.variants:
        recompute = variant[1]
        if any(_covers(t.variant, variant) for t in tried if t.walked and t.solved is not None):
            continue  # a variant that costs no more in any respect fits already
        prepared = solves.posed(variant)
        if recompute == MIXED and not joins(prepared):
            continue  # several stages per rank: one policy for all ([Note: recomputation chosen per rank])
        if recompute != MIXED and beaten(floor(prepared)):
            continue  # a forward run again, ZeRO-1's broadcast: its own floor is beaten ([Note: the search's bounds])
        try:
            cap = beaten.cap_s(microbatches, after_floor(prepared))
            solves.solved(solves.leanest(variant), cap)  # [Note: the leanest variant first]
            prepared, assignment, report = solves.solved(variant, cap, prepared)
        except BeyondCapError:
            capped.append(variant)
            continue
        except InfeasiblePlanError as exc:
            note = note or str(exc)
            continue
        except PlanError:
            return None
        splits = [_Tried(variant, prepared, split, report, beaten) for split in _splits(prepared, assignment)]
        if all(beaten(t.bound_s) for t in splits):
            tried += splits
            continue
        if any(_covers(t.variant, variant) and t.walk() for t in tried):
            continue
        if any(not beaten(t.bound_s) and t.walk() for t in splits):  # it fits: does a cheaper one capped?
            for cheaper in [c for c in capped if _covers(c, variant)]:
                capped.remove(cheaper)
                tried += solves.uncapped(cheaper, beaten)
            if any(_covers(t.variant, variant) and t.walk() for t in tried):
                continue
        tried += [t for t in splits if beaten(t.bound_s) or t.walk()]
    found = [t.solved for t in tried if t.walked and t.solved is not None]
    return found or Candidate(pp, opts.dp, opts.tp or 1, microbatches, fits=False, note=note, schedule=opts.schedule)


#: (ZeRO stage, recomputation policy, offloading): one of `offloading.variants`
_Variant = tuple[int, "str | None", bool]


class _Solves:
    """One candidate's variants (`offloading.variants`), each posed and solved by the DPs
    once, its outcome kept.

    [Note: the leanest variant first]
        ZeRO-1 and offloading each only lower every stage's memory in the solver's model
        (the optimizer state over dp; at most two microbatches' activations on the
        device), whatever the split.  So where the variant with the most of both under one
        recomputation policy fits no split, no variant of that policy does: before a
        variant's DP the leanest of its policy is solved (once, kept for its own turn),
        and where that fits nothing the variant is refused unsolved, for the same reason.
        At scale most candidates fit no variant without recomputation: on Megatron-LM's
        529.6B row at 2520 GPUs this halves the DPs (7005 to 3415; zb-v's V DPs that fit
        nothing, 828 to 369).  Where a costlier variant fits, the leanest is solved in
        vain; the candidates found are the same either way."""

    def __init__(self, base: Prepared, opts: CompileOptions, pp: int, microbatches: int,
                 variants: list[_Variant]) -> None:
        self.base, self.opts, self.pp, self.microbatches, self.variants = base, opts, pp, microbatches, variants
        self._outcomes: dict[_Variant, tuple[Prepared, tuple[int, ...], SolverReport] | PlanError] = {}

    def posed(self, variant: _Variant) -> Prepared:
        """`variant`'s problem: the base posed with its ZeRO stage, offloading and policy."""
        zero, recompute, offload = variant
        sub = dataclasses.replace(self.opts, zero=zero)
        return with_policy(_repose(self.base, sub, self.pp, self.microbatches, offload), recompute)

    def leanest(self, variant: _Variant) -> _Variant:
        """The variant of `variant`'s policy with the most ZeRO and offloading."""
        return max(v for v in self.variants if v[1] == variant[1] and v[0] >= variant[0] and v[2] >= variant[2])

    def solved(self, variant: _Variant, cap_s: float = math.inf, prepared: Prepared | None = None
               ) -> tuple[Prepared, tuple[int, ...], SolverReport]:
        """`variant` (posed as `prepared`, where given) solved, or its PlanError raised
        (InfeasiblePlanError: no split fits; BeyondCapError: none within `cap_s`, a rank's
        compute, [Note: a cap on a rank's compute]), once per variant and larger cap."""
        outcome = self._outcomes.get(variant)
        if outcome is None or isinstance(outcome, BeyondCapError) and outcome.cap_s < cap_s:
            p = prepared or self.posed(variant)
            try:
                if variant[1] == MIXED:  # the walk is checked by `_solved` alone: a candidate is one DP
                    outcome = solve_jointly(p, cap_s=cap_s)
                else:
                    outcome = (p, *_solve_one(p, cap_s))
            except PlanError as exc:
                outcome = exc
            self._outcomes[variant] = outcome
        if isinstance(outcome, PlanError):
            raise outcome
        return outcome

    def uncapped(self, variant: _Variant, beaten: Beaten) -> list[_Tried]:
        """The splits of `variant`, beaten under a cap, solved without it ([Note: a cap on a
        rank's compute]): where it covers a variant that is not beaten, whether it fits
        decides ([Note: walked only where it matters]); none where it fits nothing."""
        try:
            prepared, assignment, report = self.solved(variant)
        except PlanError:
            return []
        return [_Tried(variant, prepared, split, report, beaten) for split in _splits(prepared, assignment)]


class _Tried:
    """One split of one variant of a candidate, solved; its peak walked (`walk`) only where
    it matters.

    [Note: walked only where it matters]
        Walking a split's peak over its schedule costs more than solving it, and most of
        a large search's candidates are beaten before they are simulated.  A split whose
        bound is beaten is walked only when a costlier variant of the same candidate is
        not beaten and could be dominated by it (a variant is skipped where one that
        costs no more in any respect fits): the search then keeps exactly the candidates
        it would keep walking every split."""

    def __init__(self, variant: _Variant, p: Prepared, assignment: tuple[int, ...], report: SolverReport,
                 beaten: Callable[[float], bool]) -> None:
        self.variant, self.prepared, self.assignment, self.report = variant, p, assignment, report
        self.plan = planned(p, assignment, report)  # [Note: recomputation chosen per rank]
        self.bound_s = bound(p, assignment, self.plan)  # the copies offloading adds only lengthen it
        self.inputs: StepInputs | None = None
        if not beaten(self.bound_s):  # the tighter bound, from the simulator's inputs
            self.bound_s, self.inputs = step_bound(p, assignment, self.plan)
        self.walked = False
        self.solved: Solved | None = None

    def walk(self) -> bool:
        """Walk the peak (once): whether the split fits."""
        if not self.walked:
            self.walked, self.solved = True, _solved(self.prepared, self.assignment, self.report, self.plan,
                                                     self.bound_s, self.inputs)
        return self.solved is not None


def _covers(cheaper: _Variant, variant: _Variant) -> bool:
    """Whether `cheaper` costs no more than `variant` in any respect (ZeRO, recomputation, offloading)."""
    return (cheaper[0] <= variant[0] and variant_rank(cheaper[1]) <= variant_rank(variant[1])
            and cheaper[2] <= variant[2])


def _splits(p: Prepared, assignment: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The solver's split, and under interleaved 1F1B also the even one where it fits, each
    then simulated unless its bound is beaten ([Note: splits chosen by the simulator])."""
    if not interleaved(p.problem):
        return [assignment]
    even = even_split(p.problem)
    return [assignment] + ([even] if even != assignment and math.isfinite(objective(p.problem, even)) else [])


def _solved(p: Prepared, assignment: tuple[int, ...], report: SolverReport, plan: Plan, bound_s: float,
            inputs: StepInputs | None) -> Solved | None:
    """A candidate of `p` solved into `assignment` (`plan`, of step at least `bound_s`, its
    simulator's `inputs` where known), with its memory; None where the solver's bound fits
    the memory but the peak walked over the schedule, which the manifest reports, does not."""
    limit = p.problem.memory_limit_bytes
    if p.problem.offload or p.opts.offload == "all":  # the offloading variant only (`offloading.variants`)
        plan, peaks = offloading.fitted(p, plan)  # its shares, and the copies' time for the simulator
    else:
        peaks = rank_peaks(p, plan)
    peak = max(peaks)
    if peak > (limit or peak):
        return None
    if plan.offload:
        bound_s, inputs = step_bound(p, assignment, plan)  # bounded again with the copies' exposed time
    policy = plan_policy(plan) if p.policies is not None else p.problem.policy
    cand = Candidate(p.mesh.pp, p.opts.dp, p.opts.tp or 1, p.mesh.microbatches, memory_bytes=peak, recompute=policy,
                     schedule=p.opts.schedule, zero=plan.zero, virtual_stages=p.mesh.virtual_stages,
                     offload=bool(plan.offload))
    return Solved(cand, p, assignment, report, plan, bound_s, inputs)


def _solve_one(p: Prepared, cap_s: float = math.inf) -> tuple[tuple[int, ...], SolverReport]:
    """`p`'s problem solved by the exact DPs over contiguous plans alone (on a chain they
    are every plan): CP-SAT, which may refine a plan of a graph that is not a chain, takes
    seconds a candidate, most of them on candidates that then lose or do not fit at all;
    a mesh given with --stages/--tp/--dp gets it.  `cap_s`: a rank's compute over which
    no plan is of use ([Note: a cap on a rank's compute])."""
    return solve(p.problem, time_limit_s=0.0, explain=False, cap_s=cap_s)


def _repose(base: Prepared, opts: CompileOptions, pp: int, microbatches: int, offload: bool = False) -> Prepared:
    """`base` posed for another stage and microbatch count (same trace, costs, blocks), `offload`ing or not."""
    assert base.coarse is not None
    mesh = dataclasses.replace(mesh_of(opts, pp, stages_per_rank(opts), microbatches), offload=offload)
    problem = pose(base.coarse, mesh, base.hardware)
    return dataclasses.replace(base, opts=opts, problem=problem, blocks=base.coarse.blocks, mesh=mesh,
                               rows=base.batch // (microbatches * opts.dp))
