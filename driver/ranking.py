"""The search's candidates ranked by the simulator, each simulated only where a lower bound on
its step leaves it a chance among the SHOWN fastest ([Note: the search's bounds] in
driver/search.py): `floor` before a candidate is solved, `bound` after."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Callable

from partitioner.cost.costmodel import param_bytes_once
from partitioner.cost.roofline import BACKWARD_FLOP_FACTOR, mfu
from partitioner.ir import PartitionProblem, Plan, SolverReport
from partitioner.predict.predict import mfu_peak, simulate_plan, step_inputs
from partitioner.predict.step import StepInputs, simulate_step
from partitioner.solve.solve import is_chain

from .package_info import model_flops
from .prepared import Prepared
from .recompute import variant_rank

__all__ = ["Beaten", "Candidate", "Ranking", "SHOWN", "Solved", "after_floor", "bound", "crowded", "describe", "floor",
           "least_slowest", "simulate_fastest", "simulated", "step_bound", "walk_floor"]

SHOWN = 5
#: a bound this close to a step time still gets simulated (float sums in another order)
_BOUND_SLACK = 1e-9
#: a cap this far above the best step over M (float sums in another order)
_CAP_SLACK = 1e-6


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
    recompute: str | None = None  # the uniform policy solved; chosen with the split: every stage's, or "auto"
    schedule: str = ""
    zero: int = 0
    virtual_stages: int = 1
    offload: bool = False  # activations offloaded where the mesh binds ([Note: offloaded activations])


@dataclass
class Solved:
    """A candidate solved but not yet simulated."""

    cand: Candidate
    prepared: Prepared
    assignment: tuple[int, ...]
    report: SolverReport
    plan: Plan
    bound_s: float
    inputs: StepInputs | None = None  # the simulator's, where known (`step_bound`)


def floor(p: Prepared) -> float:
    """A step no shorter than the simulator's for any plan of `p.problem` the search makes
    (contiguous: [Note: the search's bounds]), known before it is solved: the walk's
    (`walk_floor`) and what follows it (`after_floor`)."""
    return (walk_floor(p.problem, is_chain(p.problem)) + after_floor(p)) * (1 - _BOUND_SLACK)


def walk_floor(problem: PartitionProblem, chain: bool) -> float:
    """From C, one microbatch's forward and backward of the whole model, M microbatches and
    p ranks: the busiest rank runs at least M C / p (`bound`).  Under a schedule of one
    stage per rank whose backward is whole (gpipe, 1f1b) on a chain, `bound` is the most
    over ranks r of S_r + M W_r, with W_r rank r's work and S_r all work before it; the
    least that can be over splits of C is C / (1 - (1 - 1/M)^p), where every rank's is
    equal (W_r = T/M of what is left), the pipeline's fill and drain.  With one stage per
    rank on a chain the busiest rank also runs at least the slowest of the most even
    split of the blocks into p runs (`least_slowest`): blocks do not divide; with several
    stages per rank, or off a chain, at least what whole blocks put on some rank
    (`crowded`)."""
    total, m, p = sum(problem.block_time_s), problem.microbatches, problem.ranks
    if problem.virtual_stages > 1 or not chain:
        return m * max(total / p, crowded(problem.block_time_s, p))
    even = m * least_slowest(problem.block_time_s, p)  # at least M C / p
    if problem.spec.splits_backward:
        return even
    return max(even, total / (1 - (1 - 1 / m) ** p))


@functools.lru_cache(maxsize=256)
def least_slowest(times: tuple[float, ...], parts: int) -> float:
    """At most the least, over splits of `times` into `parts` runs, of the slowest run's sum:
    bisected on whether runs of at most T can cover them (greedily), from the lower end."""
    low, high = max(max(times), sum(times) / parts), sum(times)
    if _covers(times, parts, low):
        return low
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (low, middle) if _covers(times, parts, middle) else (middle, high)
    return low


@functools.lru_cache(maxsize=256)
def crowded(times: tuple[float, ...], ranks: int) -> float:
    """At most the least, over every placement of `times` on `ranks` ranks (runs or not),
    of the busiest rank's sum: of the k ranks + 1 longest, some rank holds k + 1, at
    least the k + 1 shortest of them."""
    longest = sorted(times, reverse=True)
    return max(sum(longest[k * ranks - k:k * ranks + 1]) for k in range(len(times) // ranks + 1)
               if k * ranks < len(times))


def _covers(times: tuple[float, ...], parts: int, most: float) -> bool:
    """Whether `parts` runs of at most `most` each cover `times` in order."""
    runs, run = 1, 0.0
    for t in times:
        if run + t > most:
            runs, run = runs + 1, t
        else:
            run += t
    return runs <= parts and max(times) <= most


def after_floor(p: Prepared) -> float:
    """Of what follows the walk in `step_inputs` (the loss's all-reduce, the gradients'
    all-reduces where the backward cannot hide them, ZeRO-1's broadcast), the least over
    splits: each collective is at least its bytes' share, and the slowest of several is at
    least their mean, over P, the parameter bytes each held once.  ZeRO-1's broadcast: its
    busiest pipeline rank at least P / pp over the link; the exposed all-reduce: its
    stages' mean of 2 (dp - 1) / dp P beta less the backward, which at most every block's
    time hides (not counted where offloading's copies lengthen the backward)."""
    hw, mesh, problem = p.hardware, p.mesh, p.problem
    final = (hw.allreduce_latency_s or hw.p2p_alpha_s) if mesh.pp * mesh.tp * mesh.dp > 1 else 0.0
    if mesh.dp == 1:
        return final
    _, beta = hw.ring_link(across_nodes=mesh.pp * mesh.tp * mesh.dp > hw.devices_per_node)
    held = param_bytes_once(problem)
    zero = beta * held / mesh.pp if mesh.zero else 0.0
    hidden = sum(problem.block_time_s) if hw.overlaps_comm else 0.0
    offloads = mesh.offload or p.opts.offload == "all"
    exposed = 0.0 if offloads else max(0.0, 2 * (mesh.dp - 1) / mesh.dp * held * beta - hidden) / problem.stages
    return final + zero + exposed


def bound(prepared: Prepared, assignment: tuple[int, ...], plan: Plan, inputs: StepInputs | None = None) -> float:
    """A step no shorter than the simulator's: the most, over pipeline ranks r, of

        forward of microbatch 0 along the longest path of stages into stage r
        + every microbatch's forward and backward of every stage on rank r
        + backward of the last microbatch along the longest path out of stage r

    (rank r starts with stage r's first forward and ends with its last backward in
    every schedule; links only add).  For equal stages and free links it is (M + S - 1)
    x stage time, the step itself.  Under a zero-bubble schedule a rank's last action may
    be a W that waits for nobody: the backward path out is left out there.  With the
    simulator's own `inputs` (`step_inputs` of the plan, or of one that only adds to
    it) the stages' times are those it walks, the last stage's loss is on its rank, and
    what follows the walk (the loss all-reduce, the gradients' all-reduces, ZeRO-1's
    broadcast) is added: the tighter bound, which costs more to know."""
    costs = prepared.costs
    if inputs is None:
        forward = [sum(costs[n].forward_s for n in s.nodes) for s in plan.stages]
        backward = [s.compute_s - f for s, f in zip(plan.stages, forward)]  # recomputation included
        loss, after = 0.0, 0.0
    else:
        forward, backward = list(inputs.forward_s), list(inputs.backward_s)
        loss, after = sum(inputs.loss_s), inputs.final_s + inputs.after_s
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
    for k in range(plan.num_stages):
        work[plan.rank_of(k)] += forward[k] + backward[k]
    work[plan.rank_of(plan.num_stages - 1)] += loss  # a microbatch's loss, forward and backward
    if plan.spec.splits_backward:
        out = [0.0] * plan.num_stages
    return (max(into[r] + plan.microbatches * work[r] + out[r] for r in range(plan.pp)) + after) * (1 - _BOUND_SLACK)


def step_bound(prepared: Prepared, assignment: tuple[int, ...], plan: Plan) -> tuple[float, StepInputs]:
    """`bound` with the simulator's inputs for `plan`, and those inputs."""
    inputs = step_inputs(prepared.traced.gm, plan, prepared.costs, prepared.hardware, prepared.loss)
    return bound(prepared, assignment, plan, inputs), inputs


class Beaten:
    """Whether a candidate of step at least a bound cannot be the fastest: the bound
    exceeds `best()`, the best step simulated so far (inf: none yet)."""

    def __init__(self, best: Callable[[], float]) -> None:
        self.best = best

    def __call__(self, bound_s: float) -> bool:
        return bound_s > self.best()

    def cap_s(self, microbatches: int, after_s: float = 0.0) -> float:
        """A rank's compute per microbatch over which a plan of `microbatches` is beaten:
        a step is at least M times its busiest rank's compute and what follows the walk,
        at least `after_s` (`after_floor`), as `floor` counts them ([Note: a cap on a
        rank's compute] in partitioner/solve/solve.py)."""
        return (self.best() * (1 + _CAP_SLACK) - after_s) / microbatches


class Ranking:
    """The candidates simulated so far, fastest first: each is simulated unless its bound
    shows that it cannot be the fastest ([Note: the search's bounds])."""

    def __init__(self, devices: int, say: Callable[[str], None]) -> None:
        self.devices, self.say = devices, say
        self.beaten = Beaten(self.best_s)
        self.ranked: list[tuple[Candidate, Solved]] = []
        self._orders: dict[int, int] = {}  # each ranked item's candidate order (`insert`)
        self.skipped = 0

    def best_s(self) -> float:
        """The best step simulated so far (inf: none yet)."""
        return self.ranked[0][0].step_time_s if self.ranked else math.inf

    def insert(self, cand: Candidate, item: Solved, order: int = 0) -> None:
        """`cand`, simulated from `item`, in its place; `order`, the candidate's in the
        search, breaks the ties left (in one process or several alike)."""
        self.ranked.append((cand, item))
        self._orders[id(item)] = order
        self.ranked.sort(key=lambda r: (r[0].step_time_s, r[0].tp, r[0].pp, r[0].microbatches,
                                        variant_rank(r[0].recompute), r[0].zero, r[0].offload, r[0].virtual_stages,
                                        self._orders[id(r[1])]))
        self.say(f"  {describe(item.cand)}: {cand.step_time_s * 1e3:.3f} ms, MFU {cand.mfu * 100:.1f}%")

    def best_text(self) -> str:
        """The best so far, for the progress bar."""
        c = self.ranked[0][0] if self.ranked else None
        return "best: none yet" if c is None else f"best {c.step_time_s * 1e3:.1f} ms {describe(c)}"


def simulate_fastest(solved: list[Solved], beaten: Beaten, devices: int,
                     found: Callable[[Candidate, Solved], None]) -> int:
    """Simulate each of `solved` (in order of bound) that may still be the fastest, handing
    each simulated candidate to `found`; how many a bound skipped."""
    skipped = 0
    for item in sorted(solved, key=lambda x: x.bound_s):  # sorted is stable: mesh order breaks ties
        if beaten(item.bound_s):
            skipped += 1
            continue
        found(simulated(item, devices), item)
    return skipped


def simulated(item: Solved, devices: int) -> Candidate:
    """`item`'s candidate with the simulator's step and MFU."""
    p, c = item.prepared, item.cand
    sim = simulate_step(item.inputs) if item.inputs is not None else \
        simulate_plan(p.traced.gm, item.plan, p.costs, p.hardware, p.loss)
    flops = model_flops(p) * (1 + BACKWARD_FLOP_FACTOR) * c.microbatches * c.dp
    peak = mfu_peak(p.traced.gm, p.costs, p.hardware, p.opts.precision)[1]  # [Note: a peak per dtype]
    return dataclasses.replace(c, step_time_s=sim.step_time_s, mfu=mfu(flops, sim.step_time_s, devices, peak))


def describe(c: Candidate) -> str:
    """A candidate in one line: its mesh, microbatches, schedule and variant."""
    virtual = f" x{c.virtual_stages}" if c.virtual_stages > 1 and not c.schedule.startswith("zb") else ""
    return (f"pp={c.pp} tp={c.tp} dp={c.dp} M={c.microbatches} {c.schedule}{virtual}"
            f"{' recompute ' + c.recompute if c.recompute else ''}{' zero-1' if c.zero else ''}"
            f"{' offload' if c.offload else ''}")
