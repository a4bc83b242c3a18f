"""Calibration: node times made to add up to what a whole graph, or each stage run as a rank
runs it, takes (`calibrate_graph`, `calibrate_stages`), timed on the device the graph's values
live on through its timer (timer.py); and each stage's peak memory where the device counts
it (`stage_peak_bytes`).

[Note: compute after a wait]
    Each forward and backward a calibration times follows an idle of
    `Hardware.idle_before_compute_s` (one message's wait where gloo's threads share the cores;
    0 on GPUs), because on the CPU compute right after an idle runs slower than the same compute
    looped, and a rank idles before most of its passes.  The measurements:
    docs/notes/compute-after-a-wait.md.

[Note: stages timed side by side]
    With `ranks`, every rank's stages are timed at once, each rank in a forked process bound
    to its own cores and keeping freed memory as a rank does (runtime/malloc.py), and each keeps
    running its last stage until all have finished: every sample is taken with the other ranks
    computing, as in the schedule's steady state (the pipeline's fill and drain are then slightly
    overestimated).  Why: docs/notes/stages-side-by-side.md.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import multiprocessing.connection
import statistics
import threading
import time
from typing import Any, Callable, Sequence

import torch
import torch.fx

from ..ir import NodeCost
from .nodes import compute_nodes, needs_grad, tensors
from .timer import CPU_TIMER, DeviceTimer

__all__ = ["CALIBRATION_MIN_S", "CalibrationError", "calibrate_graph", "calibrate_stages", "forward_backward",
           "stage_peak_bytes", "time_forward_backward"]

#: the most per-op overhead (dispatch, autograd bookkeeping) calibration adds to one node
OP_OVERHEAD_S = 25e-6

#: how long each stage is timed at least by `calibrate_stages` (its samples' median): a
#: stage's median over a few tens of milliseconds varies too much on a shared machine
#: (docs/notes/calibration-length.md)
CALIBRATION_MIN_S = 1.0


def calibrate_graph(gm: torch.fx.GraphModule, values: dict[torch.fx.Node, Any], costs: dict[str, NodeCost],
                    repeats: int, wait_s: float = 0.0, min_s: float = 0.0,
                    timer: DeviceTimer = CPU_TIMER) -> dict[str, NodeCost]:
    """Node times made to add up to the whole graph's.

    The graph is run as a stage runs it: one forward (autograd recording) and one backward
    from every output that needs a gradient, parameters' `.grad` accumulated, each after
    idling `wait_s` as a stage waits for its input (see below); median of 3 x `repeats` (at
    least 15), and of more while under `min_s` seconds. Where the whole takes longer than
    the sum of its nodes alone, the difference is partly per-op overhead that isolation
    cannot see (the generated code's dispatch, the engine's bookkeeping, AccumulateGrad),
    added to every node in equal shares of at most OP_OVERHEAD_S, and partly the ops running
    slower together than alone, which scales every node in proportion; where the whole takes
    less, the node times are scaled down in proportion. Forward and backward separately. Any
    failure (an in-place op on an input, say) leaves the isolated times as they are.
    `timer`: the timer of the device the values live on.
    """
    timed = [n for n in compute_nodes(gm) if costs[n.name].forward_s > 0]
    if not timed:
        return costs
    inputs = [values[n] for n in gm.graph.nodes if n.op == "placeholder"]
    params = [p for p in gm.parameters() if p.requires_grad]
    saved = [p.grad for p in params]
    try:
        plain = _plain(gm)
    except Exception:
        return costs

    try:
        # the whole graph is cheap: more samples, less noise
        fwd, bwd = time_forward_backward(lambda: plain(*inputs), max(3 * repeats, 15), wait_s, min_s, timer)
    except Exception:  # in-place ops on inputs, and whatever else only the whole graph meets
        return costs
    finally:
        for p, g in zip(params, saved):
            p.grad = g
    out = dict(costs)
    in_backward = [n.name for n in timed if needs_grad(values.get(n))]
    for attr, whole, names in (("forward_s", fwd, [n.name for n in timed]), ("backward_s", bwd, in_backward)):
        with_time = [n for n in names if attr == "backward_s" or getattr(costs[n], attr) > 0]
        parts = sum(getattr(costs[n], attr) for n in with_time)
        if not with_time or parts <= 0 or whole <= 0:
            continue
        # Per-op overhead is a few microseconds an op: up to OP_OVERHEAD_S per node of the
        # difference is added in equal shares; the rest (or a shortfall) scales every node
        # in proportion, as cache and memory effects do.
        extra = whole - parts
        share = min(max(extra, 0.0) / len(with_time), OP_OVERHEAD_S)
        scale = (whole - share * len(with_time)) / parts
        for name in with_time:
            t = getattr(out[name], attr)
            out[name] = dataclasses.replace(out[name], **{attr: t * scale + share})
    return out


def time_forward_backward(forward: Callable[[], Any], samples: int, wait_s: float = 0.0,
                          min_s: float = 0.0, timer: DeviceTimer = CPU_TIMER) -> tuple[float, float]:
    """Median seconds of `forward()` (autograd recording) and of the backward from every
    floating output that needs a gradient (ones as their gradients), each after idling
    `wait_s`, over `samples` samples after one warm-up, and more until `min_s` seconds have
    passed: a stage's forward and backward as a rank runs them, timed by `timer` (its
    device's clock: events on CUDA).
    `benchmarks/simulator_error.py` times the generated stages with it during the run, as
    the compile timed their graphs."""
    forwards: list[float] = []
    backwards: list[float] = []
    until = time.perf_counter() + min_s
    i = 0
    while i <= samples or time.perf_counter() < until:
        if wait_s:
            time.sleep(wait_s)
        forwarded, outs = timer.timed(lambda: _grad_outputs(forward))
        grads = [torch.ones_like(t) for t in outs]
        if wait_s:
            time.sleep(wait_s)
        backwarded = timer.time(lambda: torch.autograd.backward(outs, grads)) if outs else 0.0
        if i:  # the first is a warm-up
            forwards.append(forwarded)
            backwards.append(backwarded)
        i += 1
    return statistics.median(forwards), statistics.median(backwards)


def _grad_outputs(forward: Callable[[], Any]) -> list[torch.Tensor]:
    """`forward()` with autograd recording: its floating outputs that need a gradient."""
    with torch.enable_grad():
        return [t for t in tensors(forward()) if t.requires_grad and (t.is_floating_point() or t.is_complex())]


def forward_backward(forward: Callable[[], Any]) -> None:
    """One forward and backward as `time_forward_backward` times them, untimed."""
    outs = _grad_outputs(forward)
    if outs:
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])


def calibrate_stages(gm: torch.fx.GraphModule, values: dict[torch.fx.Node, Any], costs: dict[str, NodeCost],
                     stage_of: dict[str, int], repeats: int, wait_s: float,
                     ranks: Sequence[tuple[Sequence[int], set[int]]] = (),
                     timer: DeviceTimer = CPU_TIMER) -> dict[str, NodeCost]:
    """Node times made to add up to each stage's, run as a rank runs it.

    `calibrate_graph` on each stage's own graph: its inputs from other stages become leaves
    (as `runtime.stage.as_leaf` makes them), its outputs are what other stages read, and
    each forward and backward follows a `wait_s` idle, as a pipeline rank's do.  A stage
    costs more than its share of the whole graph's time: it starts autograd's engine on
    its own, and it pays the slow start after a wait once per stage, not once per model
    ([Note: compute after a wait]).  The plan is not changed, only its predicted times.

    `ranks`, one (stages, cores) per rank, calibrates the ranks side by side, as they
    compute ([Note: stages timed side by side]); without it the stages are timed one
    after the other in this process (CPU ranks only: the ranks' processes are forked, which
    CUDA does not survive).
    """
    if ranks:
        return _calibrate_side_by_side(gm, values, costs, stage_of, repeats, wait_s, ranks, timer)
    out = dict(costs)
    for stage in sorted(set(stage_of.values())):
        out = calibrate_graph(*_stage_graph(gm, values, _members(stage_of, stage)), out, repeats, wait_s,
                              CALIBRATION_MIN_S, timer)
    return out


def stage_peak_bytes(gm: torch.fx.GraphModule, values: dict[torch.fx.Node, Any], stage_of: dict[str, int],
                     timer: DeviceTimer) -> list[int | None]:
    """Each stage's peak memory over one forward and backward as a rank runs it, by the
    allocator's count above what was allocated before (the values it keeps for backward,
    the gradients it sends back, the ops' workspace; the weights' gradients are allocated by
    a first, untimed pass, as they are from a rank's second step on); None per stage where
    the device keeps no count (the CPU), without running anything."""
    stages = sorted(set(stage_of.values()))
    if not timer.counts_memory:
        return [None] * len(stages)
    peaks: list[int | None] = []
    for stage in stages:
        sub, sub_values = _stage_graph(gm, values, _members(stage_of, stage))
        inputs = [sub_values[n] for n in sub.graph.nodes if n.op == "placeholder"]
        plain = _plain(sub)
        params = [p for p in sub.parameters() if p.requires_grad]
        saved = [p.grad for p in params]
        try:
            forward_backward(lambda: plain(*inputs))
            peaks.append(timer.peak_bytes(lambda: forward_backward(lambda: plain(*inputs))))
        finally:
            for p, g in zip(params, saved):
                p.grad = g
    return peaks


def _members(stage_of: dict[str, int], stage: int) -> set[str]:
    return {name for name, s in stage_of.items() if s == stage}


class CalibrationError(RuntimeError):
    """Timing the stages side by side failed (a rank's process died or overran)."""



def _calibrate_side_by_side(gm: torch.fx.GraphModule, values: dict[torch.fx.Node, Any], costs: dict[str, NodeCost],
                            stage_of: dict[str, int], repeats: int, wait_s: float,
                            ranks: Sequence[tuple[Sequence[int], set[int]]], timer: DeviceTimer) -> dict[str, NodeCost]:
    ctx = multiprocessing.get_context("fork")  # the children share the graph and its values, copy-on-write
    start = ctx.Barrier(len(ranks))
    finished = ctx.Value("i", 0)
    pipes, children = [], []
    try:
        for stages, cores in ranks:
            mine, theirs = ctx.Pipe(duplex=False)
            child = ctx.Process(target=_time_rank, daemon=True,
                                args=(theirs, gm, values, costs, stage_of, list(stages), cores, repeats, wait_s,
                                      start, finished, len(ranks), timer))
            child.start()
            theirs.close()
            pipes.append(mine)
            children.append(child)
        answers = _answers(pipes, [list(stages) for stages, _cores in ranks])
        out = dict(costs)
        timed: set[int] = set()
        for (stages, _cores), got in zip(ranks, answers):
            for stage in stages:  # data-parallel replicas time the same stages: the first answer counts
                if stage not in timed:
                    timed.add(stage)
                    out.update({name: got[name] for name, s in stage_of.items() if s == stage})
        return out
    except (EOFError, OSError) as e:
        raise CalibrationError(f"a rank timing its stages died: {e}") from e
    finally:
        for child in children:
            child.join(1.0)
            if child.is_alive():
                child.kill()
                child.join(1.0)


_SIDE_BY_SIDE_TIMEOUT_S = 300.0


def _answers(pipes: list[Any], stages: list[list[int]]) -> list[dict[str, NodeCost]]:
    """Every rank's timings, in rank order.  A rank that fails breaks the start barrier
    for the others, which then report only that; so the failure named is the rank's own
    ("failed"), and a broken barrier ("aborted") only when no rank says why."""
    answers: dict[int, dict[str, NodeCost]] = {}
    aborted = ""
    deadline = time.monotonic() + _SIDE_BY_SIDE_TIMEOUT_S
    while len(answers) < len(pipes):
        waiting = {i: pipe for i, pipe in enumerate(pipes) if i not in answers}
        ready = multiprocessing.connection.wait(list(waiting.values()), max(0.0, deadline - time.monotonic()))
        if not ready:
            late = [stages[i] for i in waiting]
            raise CalibrationError(f"ranks timing stages {late} gave no answer in {_SIDE_BY_SIDE_TIMEOUT_S:.0f} s")
        for i, pipe in waiting.items():
            if pipe in ready:
                kind, got = pipe.recv()
                if kind == "failed":
                    raise CalibrationError(got)
                if kind == "aborted":
                    aborted, got = got, {}
                answers[i] = got
    if aborted:
        raise CalibrationError(aborted)
    return [answers[i] for i in range(len(pipes))]


def _time_rank(conn: Any, gm: torch.fx.GraphModule, values: dict[torch.fx.Node, Any], costs: dict[str, NodeCost],
               stage_of: dict[str, int], stages: list[int], cores: set[int], repeats: int, wait_s: float,
               start: Any, finished: Any, ranks: int, timer: DeviceTimer) -> None:
    """One rank's side of `_calibrate_side_by_side`, in its forked process."""
    from runtime.affinity import bind_threads
    from runtime.malloc import keep_freed_memory

    done = False

    def finish() -> None:
        nonlocal done
        if not done:
            done = True
            with finished.get_lock():
                finished.value += 1

    try:
        bind_threads(cores)
        keep_freed_memory()  # as a rank does (runtime/malloc.py); this process is the rank's stand-in
        graphs = [_stage_graph(gm, values, _members(stage_of, stage)) for stage in stages]  # before the start
        start.wait(_SIDE_BY_SIDE_TIMEOUT_S)
        out = dict(costs)
        for sub, sub_values in graphs:
            out = calibrate_graph(sub, sub_values, out, repeats, wait_s, CALIBRATION_MIN_S, timer)
        finish()
        while finished.value < ranks:  # beside the ranks still timing theirs
            calibrate_graph(*graphs[-1], costs, 1, wait_s, 0.0, timer)
        conn.send(("timed", {name: out[name] for name, s in stage_of.items() if s in stages}))
    except threading.BrokenBarrierError:  # another rank failed (it says why) or never reached the start
        finish()
        conn.send(("aborted", "the ranks' start barrier broke: a rank failed or did not reach it in time"))
    except Exception as e:  # told to the parent, which falls back to timing alone
        start.abort()  # nobody waits for this rank to start
        finish()  # nor to finish
        conn.send(("failed", f"{type(e).__name__}: {e}"))
    finally:
        conn.close()


def _stage_graph(gm: torch.fx.GraphModule, values: dict[torch.fx.Node, Any],
                 names: set[str]) -> tuple[torch.fx.GraphModule, dict[torch.fx.Node, Any]]:
    """The graph of the compute nodes `names` (same node names), a placeholder per value
    they read from outside, and every value another stage (or the output) reads as its
    outputs; with the example values of its nodes, inputs as fresh leaves."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    sub_values: dict[torch.fx.Node, Any] = {}
    members = [n for n in gm.graph.nodes if n.name in names]
    for node in members:  # a value made outside the stage arrives as an input
        for x in node.all_input_nodes:
            if x not in env and x.name not in names and x.op != "get_attr":
                env[x] = graph.placeholder(x.name)
                value = values.get(x)
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    value = value.detach().requires_grad_(value.requires_grad)
                sub_values[env[x]] = value

    def read(x: torch.fx.Node) -> torch.fx.Node:
        if x not in env:  # a parameter or buffer
            env[x] = graph.node_copy(x)
        return env[x]

    for node in members:
        env[node] = graph.node_copy(node, read)
        sub_values[env[node]] = values.get(node)
    graph.output(tuple(env[n] for n in members if any(u.name not in names for u in n.users)))
    return torch.fx.GraphModule(gm, graph), sub_values


def _plain(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The graph as plain generated Python over flat positional tensors, as a stage's code
    is: torch.export's module checks and unflattens its pytree inputs, which the graph's
    placeholders (one per flat input) are not."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return torch.fx.GraphModule(gm, graph)

