"""Node costs as the compile takes them: measured once per graph and machine and cached
(`node_costs`), and calibrated stage by stage for a plan (`calibrated_costs`, with each stage's
peak memory where the device counts it: `stage_peaks`), cached per plan so that compiles
on one machine stay byte-identical.  Every measurement goes through the timer of the device
the model runs on (`Prepared.timer`, [Note: where the compile runs the model] in phases.py),
whose `key` is part of every cache key."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import asdict
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree

from partitioner.cost import cache
from partitioner.cost.calibrate import CALIBRATION_MIN_S, CalibrationError, calibrate_stages, stage_peak_bytes
from partitioner.cost.hardware import Hardware
from partitioner.cost.loss import loss_cost
from partitioner.cost.measure import RANK_THREADS, rank_threads
from partitioner.cost.nodes import compute_nodes
from partitioner.cost.profile import PROFILE_VERSION, annotate
from partitioner.cost.timer import DeviceTimer
from partitioner.ir import NodeCost, Plan
from partitioner.trace import model_file
from partitioner.trace.trace import Traced

from runtime.affinity import binding_enabled, bound_as_local_rank, cpu_share
from runtime.precision import loss_input

from .options import CompileOptions
from .prepared import Prepared

__all__ = ["loss_costs", "node_costs", "calibrated_costs", "calibrated_costs_in_turn", "stage_peaks"]


def node_costs(gm: torch.fx.GraphModule, values: dict[torch.fx.Node, Any], hardware: Hardware,
               opts: CompileOptions, say: Callable[[str], None], timer: DeviceTimer) -> dict[str, NodeCost]:
    """Every compute node's cost (`partitioner.cost.profile.annotate`), measured with `timer`
    or analytic; measured costs are cached per graph, shapes, machine and device."""
    measure = not opts.analytic
    wait = hardware.idle_before_compute_s
    key = "profile-" + hashlib.sha256(
        json.dumps([PROFILE_VERSION, gm.code, [str(n.meta.get("tensor_meta")) for n in gm.graph.nodes],
                    hardware.name, measure, opts.repeats, torch.__version__, RANK_THREADS,
                    wait, timer.key]).encode()
    ).hexdigest()[:32] if measure else ""  # analytic costs are not cached (nor the graph compiled to name them)
    cached = None if (opts.reprofile or not measure) else cache.get(key)
    nodes = compute_nodes(gm)
    if cached is not None and set(cached) == {n.name for n in nodes}:
        costs = {name: NodeCost(**c) for name, c in cached.items()}
        say(f"costs: {len(costs)} nodes from the profile cache (--reprofile to measure again)")
        for line in cache.get(key + "-notes") or []:  # nodes costed analytically when measured
            say(str(line))
        return costs
    say(f"costs: {'profiling' if measure else 'estimating'} {len(nodes)} nodes on {hardware.name}"
        + (f", measured on {timer.key}" if measure and timer.is_cuda else ""))
    notes: list[str] = []  # said again whenever the cached costs are read

    def note(line: str) -> None:
        notes.append(line)
        say(line)

    costs = annotate(gm, values, hardware, measure, opts.repeats, _progress(opts, len(nodes)), wait, timer, note)
    if measure:
        cache.put(key, {name: asdict(c) for name, c in costs.items()})
        cache.put(key + "-notes", notes)
    return costs


def loss_costs(mf: model_file.ModelFile, traced: Traced, values: dict[torch.fx.Node, Any], hardware: Hardware,
               opts: CompileOptions, batch: int, rows: int, say: Callable[[str], None],
               timer: DeviceTimer) -> NodeCost | None:
    """The loss's cost on one microbatch (`partitioner.cost.loss`, measured with `timer`), or
    None when the model file defines no loss; measured costs are cached as node costs are."""
    if not (mf.has("loss_fn") and mf.has("example_target")):
        return None
    leaves = [values.get(x, x) if isinstance(x, torch.fx.Node) else x for x in traced.output_leaves]
    output = loss_input(pytree.tree_unflatten(leaves, traced.out_spec), opts.precision)  # as the runtime gives it
    target = pytree.tree_map_only(torch.Tensor, lambda t: (t.narrow(0, 0, rows) if t.dim() and t.shape[0] == batch
                                                           else t).to(timer.device), mf.example_target())
    measure = not opts.analytic
    key = "loss-" + hashlib.sha256(json.dumps(
        [PROFILE_VERSION, mf.sha256, traced.gm.code, [str(x.meta.get("tensor_meta")) for x in traced.gm.graph.nodes],
         hardware.name, measure, opts.repeats, torch.__version__, RANK_THREADS, rows, timer.key]
    ).encode()).hexdigest()[:32] if measure else ""
    cached = None if (opts.reprofile or not measure) else cache.get(key)
    if isinstance(cached, dict):
        return NodeCost(**cached)
    try:
        cost = loss_cost(mf.loss_fn(), output, target, hardware, measure, opts.repeats, timer)
    except Exception as exc:  # the runtime will say what is wrong with the loss; cost it by its output
        say(f"warning: loss_fn failed on the traced output ({type(exc).__name__}: {exc}); costing the loss by "
            f"the output's size")
        cost = loss_cost(mf.loss_fn(), output, target, hardware, False, opts.repeats)
    if measure:
        cache.put(key, asdict(cost))
    return cost


def _progress(opts: CompileOptions, total: int) -> Callable[[Iterable[torch.fx.Node]], Iterable[torch.fx.Node]]:
    if opts.quiet or not sys.stderr.isatty():
        return iter
    from tqdm import tqdm

    return lambda items: tqdm(items, total=total, desc="profiling", unit="node", leave=False)


def calibrated_costs(p: Prepared, plan: Plan) -> dict[str, NodeCost]:
    """The node costs the prediction uses: where costs are measured and either stages wait
    for messages on the cores they compute on (the cpu profile) or they run on a GPU,
    calibrated stage by stage as a rank runs them (`partitioner.cost.calibrate.calibrate_stages`:
    on the CPU after a message's wait, on a rank's thread and cores, every rank beside the
    others when each has cores of its own), cached per plan so that compiles on one machine
    stay byte-identical; else the costs as they are (`p.costs` itself)."""
    return calibrated_costs_in_turn(p, [plan], 1)[0][0]


def calibrated_costs_in_turn(p: Prepared, plans: Sequence[Plan], rounds: int) -> list[list[dict[str, NodeCost]]]:
    """`rounds` calibrations of each of `plans` (as `calibrated_costs` calibrates one), taken in
    turn, a different plan first each round, so that the machine's drift falls on all of
    them alike: per plan, its calibrations in round order.  Cached as one, so that a compile
    that chooses between the plans by them stays byte-identical on one machine; a fallback
    to one stage at a time is not cached, so the next compile tries side by side again."""
    if not all(_calibrates(p, plan) for plan in plans):
        return [[p.costs] * rounds for _ in plans]
    key = _stage_key(p, plans, rounds)
    cached = None if p.opts.reprofile else cache.get(key)
    if (isinstance(cached, list) and len(cached) == len(plans)
            and all(len(per_plan) == rounds and all(set(got) == set(p.costs) for got in per_plan) for per_plan in cached)):
        return [[{name: NodeCost(**c) for name, c in got.items()} for got in per_plan] for per_plan in cached]
    timed: list[list[dict[str, NodeCost]]] = [[] for _ in plans]
    failed = False
    for r in range(rounds):
        for k, i in enumerate((r + k) % len(plans) for k in range(len(plans))):
            costs, fell_back = _calibrate(p, plans[i], _count(r * len(plans) + k, i, r, len(plans), rounds))
            timed[i].append(costs)
            failed = failed or fell_back
    if not failed:
        cache.put(key, [[{name: asdict(c) for name, c in got.items()} for got in per_plan] for per_plan in timed])
    return timed


def _calibrates(p: Prepared, plan: Plan) -> bool:
    """Whether `calibrated_costs` calibrates `plan`'s stages (else the model's costs stand)."""
    waits = p.hardware.idle_before_compute_s > 0  # the cpu profile: stages wait on the cores they compute on
    return (not p.opts.analytic and (waits or p.timer.is_cuda) and p.values is not None and plan.num_stages >= 2
            and not plan.recomputes)


def _stage_key(p: Prepared, plans: Sequence[Plan], rounds: int) -> str:
    """The cache key of `rounds` calibrations of `plans` in turn."""
    return "stages-" + hashlib.sha256(json.dumps([
        PROFILE_VERSION, p.traced.gm.code, [sorted(plan.stage_of().items()) for plan in plans],
        p.hardware.idle_before_compute_s, p.opts.repeats, CALIBRATION_MIN_S, torch.__version__, RANK_THREADS,
        [binding_enabled() and plan.pp * plan.tp * plan.dp for plan in plans],
        [[(stages, sorted(cores)) for stages, cores in _side_by_side(p, plan)] for plan in plans],
        sorted((n, asdict(c)) for n, c in p.costs.items()), p.timer.key, rounds]).encode()).hexdigest()[:32]


def _side_by_side(p: Prepared, plan: Plan) -> list[tuple[list[int], set[int]]]:
    return [] if p.timer.is_cuda else _rank_cores(plan)  # forked ranks: CPU only


def _count(done: int, plan: int, round_: int, plans: int, rounds: int) -> str:
    """Where one calibration stands among `plans` x `rounds` of them, for its progress line
    ('' for a single one): "3 of 6: plan 2 of 2, round 2 of 3"."""
    if plans * rounds == 1:
        return ""
    return f" ({done + 1} of {plans * rounds}: plan {plan + 1} of {plans}, round {round_ + 1} of {rounds})"


def _calibrate(p: Prepared, plan: Plan, count: str = "") -> tuple[dict[str, NodeCost], bool]:
    """`plan`'s stages calibrated now, side by side where every rank has cores of its own;
    True where that failed and they were timed one at a time instead.  `count`: where this
    calibration stands among the phase's (`_count`), said on its progress line."""
    assert p.values is not None  # _calibrates
    values, stage_of = p.values, plan.stage_of()
    side_by_side = _side_by_side(p, plan)
    wait = p.hardware.idle_before_compute_s
    p.say(f"calibrating {plan.num_stages} stages as the ranks run them"
          + (f", {len(side_by_side)} ranks side by side" if side_by_side else "") + count)
    with rank_threads():  # on a rank's threads and cores (runtime/affinity.py)
        if side_by_side:
            try:
                return calibrate_stages(p.traced.gm, values, p.costs, stage_of, p.opts.repeats, wait, side_by_side,
                                        p.timer), False
            except CalibrationError as e:
                p.say(f"warning: timing the stages side by side failed ({e}); timing them one at a time")
        with bound_as_local_rank(0, plan.pp * plan.tp * plan.dp):
            costs = calibrate_stages(p.traced.gm, values, p.costs, stage_of, p.opts.repeats, wait, (), p.timer)
    return costs, bool(side_by_side)


def stage_peaks(p: Prepared, plan: Plan) -> list[int] | None:
    """Each stage's peak memory over one microbatch's forward and backward, as the allocator
    counts it (`partitioner.cost.calibrate.stage_peak_bytes`), where the compile measures on a
    device that keeps a count (CUDA), cached per plan as `calibrated_costs` is; else None."""
    if p.opts.analytic or not p.timer.counts_memory or p.values is None or plan.recomputes:
        return None
    stage_of = plan.stage_of()
    key = "peaks-" + hashlib.sha256(json.dumps(
        [PROFILE_VERSION, p.traced.gm.code, sorted(stage_of.items()), torch.__version__, p.timer.key]).encode()
    ).hexdigest()[:32]
    cached = None if p.opts.reprofile else cache.get(key)
    if isinstance(cached, list) and len(cached) == len(set(stage_of.values())):
        return [int(b) for b in cached]
    peaks = [b or 0 for b in stage_peak_bytes(p.traced.gm, p.values, stage_of, p.timer)]
    cache.put(key, peaks)
    return peaks


def _rank_cores(plan: Plan) -> list[tuple[list[int], set[int]]]:
    """Each rank's stages and the cores the runtime binds it to, when every rank gets
    cores of its own on this machine (`runtime.affinity.cpu_share`); else none.  Rank r
    holds the stages at position r // tp % pp (runtime/groups.py, `Plan.rank_of`)."""
    ranks = plan.pp * plan.tp * plan.dp
    if not binding_enabled() or ranks < 2 or not hasattr(os, "sched_getaffinity"):
        return []
    allowed = os.sched_getaffinity(0)
    shares = [cpu_share(allowed, r, ranks) for r in range(ranks)]
    if any(share is None for share in shares):
        return []
    count = len(plan.stages)
    return [([s for s in range(count) if plan.rank_of(s) == r // plan.tp % plan.pp], share)
            for r, share in enumerate(shares) if share is not None]
