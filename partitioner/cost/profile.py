"""Annotate: every compute node gets a `NodeCost` in `node.meta["cost"]`.

Two sources, one result type:

- `profile`: measured on this machine.  Each node is re-run in isolation on its real
  microbatch inputs: forward (with autograd recording, as in training) and backward timed
  `repeats` times (median), FLOPs from `torch.utils.flop_counter.FlopCounterMode`, and
  activation bytes from the tensors autograd saves for backward
  (`torch.autograd.graph.saved_tensors_hooks`), parameters excluded.  The node times are
  then calibrated against the whole graph run as one forward and one backward
  (`_calibrate`): what isolation misses (the generated forward's own dispatch, the
  autograd engine walking one graph, gradient accumulation) is spread over the nodes, so
  the sum of a stage's node times is what the stage takes.
- `estimate`: analytic, from the same FLOP count and the bytes the op reads and writes,
  through the roofline of a hardware profile (`roofline.py`).  Deterministic, so golden
  tests and CI use it.  On the meta device (a model too large to run here) every tensor
  is a shape, so the FLOPs and saved bytes of equal calls (the same op in identical
  layers) are counted once, and attention saves what a fused kernel saves (`_flash_saved`).
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import multiprocessing.connection
import statistics
import threading
import time
from typing import Any, Callable, Hashable, Iterable, Sequence

import torch
import torch.fx
from torch.utils.flop_counter import FlopCounterMode

from .hardware import Hardware
from .ir import NodeCost
from .roofline import BACKWARD_FLOP_FACTOR, roofline_s

__all__ = ["PROFILE_VERSION", "CalibrationError", "annotate", "calibrate_stages", "compute_nodes", "param_names", "storage_key",
           "time_forward_backward"]

#: what a measured profile means; part of a profile cache key, so that profiles measured
#: by older code (forward under no_grad, no whole-graph calibration, calibration without
#: the wait before each pass) are measured again
PROFILE_VERSION = 4

#: the most per-op overhead (dispatch, autograd bookkeeping) calibration adds to one node
OP_OVERHEAD_S = 25e-6

#: how long each stage is timed at least by `calibrate_stages` (its samples' median): on a
#: shared VM a stage's median over 15 samples (~50 ms) varies 1.40x between the 10th and
#: 90th percentile of such snapshots, over ~0.9 s 1.16x (NCF's first stage, 20 s of them)
CALIBRATION_MIN_S = 1.0


def compute_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]


def param_names(node: torch.fx.Node, params: set[str]) -> tuple[str, ...]:
    """Original names of the parameters `node` reads directly."""
    return tuple(sorted({str(a.target) for a in node.all_input_nodes if a.op == "get_attr" and a.target in params}))


def annotate(
    gm: torch.fx.GraphModule,
    values: dict[torch.fx.Node, Any],
    hardware: Hardware,
    measure: bool,
    repeats: int = 5,
    progress: Callable[[Iterable[torch.fx.Node]], Iterable[torch.fx.Node]] = iter,
    wait_s: float = 0.0,
) -> dict[str, NodeCost]:
    """Write `node.meta["cost"]` on every compute node; return the costs by node name.
    `wait_s`: how long a pipeline stage idles before each forward and backward (waiting
    for its input), which the calibration reproduces; see [Note: compute after a wait]."""
    params = {name: p for name, p in gm.named_parameters(remove_duplicate=False)}
    param_storages = {storage_key(p) for p in params.values()}
    costs: dict[str, NodeCost] = {}
    overhead = _backward_overhead(repeats) if measure else 0.0
    seen: dict[Hashable, tuple[int, int]] = {}
    for node in progress(compute_nodes(gm)):
        fn, args, kwargs = _bind(node, values)
        key = _meta_signature(node, args, kwargs, param_storages)
        if key is None or key not in seen:
            found = _flops_and_saved(fn, args, kwargs, param_storages)
            flash = _flash_saved(node, args, values.get(node))
            found = found if flash is None else (found[0], flash)
            if key is not None:
                seen[key] = found
        flops, activation = seen[key] if key is not None else found
        moved = _bytes(args) + _bytes(kwargs) + _bytes(values.get(node))
        if measure:
            fwd, bwd = _time(fn, args, kwargs, repeats)
            bwd = max(0.0, bwd - overhead) if bwd else 0.0
        else:
            fwd = roofline_s(flops, moved, hardware.peak_flops, hardware.memory_bandwidth, hardware.efficiency)
            bwd = BACKWARD_FLOP_FACTOR * fwd if _needs_grad(values.get(node)) else 0.0
        cost = NodeCost(
            name=node.name,
            forward_s=fwd,
            backward_s=bwd,
            flops=flops,
            param_bytes=sum(_nbytes(params[p]) for p in param_names(node, set(params))),
            activation_bytes=activation,
            output_bytes=_bytes(values.get(node)),
        )
        node.meta["cost"] = cost
        costs[node.name] = cost
    if measure:
        costs = _calibrate(gm, values, costs, repeats, wait_s)
        for node in compute_nodes(gm):
            node.meta["cost"] = costs[node.name]
    return costs


# -- running one node --------------------------------------------------------------------


def _bind(node: torch.fx.Node, values: dict[torch.fx.Node, Any]) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    """The node as a plain call on fresh autograd leaves that share the real storage."""

    def leaf(n: torch.fx.Node) -> Any:
        v = values[n]
        if isinstance(v, torch.Tensor):
            return v.detach().requires_grad_(v.requires_grad)
        return v

    args = torch.fx.node.map_arg(node.args, leaf)
    kwargs = torch.fx.node.map_arg(node.kwargs, leaf)
    if node.op == "call_method":
        name = str(node.target)
        return (lambda self, *a, **k: getattr(self, name)(*a, **k)), tuple(args), dict(kwargs)
    return node.target, tuple(args), dict(kwargs)  # type: ignore[return-value]


def storage_key(t: torch.Tensor) -> int:
    """Identifies a tensor's storage, shared by its views; meta tensors included."""
    return int(t.untyped_storage()._cdata)


def _meta_signature(node: torch.fx.Node, args: tuple[Any, ...], kwargs: dict[str, Any],
                    param_storages: set[int]) -> Hashable | None:
    """What decides a call's FLOPs and saved bytes when every tensor is on the meta device
    (so only shapes count): the target, and each argument's shape, strides, dtype, grad,
    whether it is a parameter and which arguments share storage.  Equal signatures (the
    same op in each of a model's identical layers) are counted once.  None when a tensor
    holds data, or an argument is not a plain value."""
    storages: dict[int, int] = {}

    def describe(value: Any) -> Hashable:
        if isinstance(value, torch.Tensor):
            if not value.is_meta:
                raise _NotPlain
            key = storage_key(value)
            return ("T", tuple(value.shape), value.stride(), value.storage_offset(), value.dtype,
                    value.requires_grad, key in param_storages, storages.setdefault(key, len(storages)))
        if isinstance(value, (list, tuple)):
            return (type(value).__name__, tuple(describe(v) for v in value))
        if isinstance(value, dict):
            return ("dict", tuple((k, describe(v)) for k, v in value.items()))
        if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device, torch.memory_format,
                                               torch.layout, slice)):
            return (type(value).__name__, repr(value))
        raise _NotPlain

    try:
        return (node.op, node.target, describe(args), describe(kwargs))
    except (_NotPlain, TypeError):
        return None


_ATTENTION = (torch.nn.functional.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default)


def _flash_saved(node: torch.fx.Node, args: tuple[Any, ...], out: Any) -> int | None:
    """What a fused (flash) attention kernel saves for backward, for attention on the
    meta device, else None.

    On the meta device (a model planned for GPUs, too large to run here) the dispatcher
    takes scaled_dot_product_attention's math path, which saves the (B, heads, L, S)
    attention matrix; the GPUs it is planned for run a fused kernel, which saves q, k, v,
    the output and one float32 log-sum-exp per query row (Dao et al., "FlashAttention",
    NeurIPS 2022, section 3.1), and so is counted here.
    """
    if node.op != "call_function" or node.target not in _ATTENTION or not isinstance(out, torch.Tensor):
        return None
    q, k, v = args[:3] if len(args) >= 3 else (None, None, None)
    tensors = [t for t in (q, k, v, out) if isinstance(t, torch.Tensor)]
    if len(tensors) != 4 or not all(t.is_meta and t.dim() == 4 for t in tensors):
        return None
    rows = math.prod(int(d) for d in q.shape[:3])  # type: ignore[union-attr]
    return sum(_nbytes(t) for t in tensors) + 4 * rows


class _NotPlain(Exception):
    """An argument that `_meta_signature` cannot describe."""


def _flops_and_saved(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], param_storages: set[int]) -> tuple[int, int]:
    """Forward FLOPs of one call, and the bytes of activations autograd saves for backward."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in param_storages:
            saved[key] = max(saved.get(key, 0), t.numel() * t.element_size())
        return t

    counter = FlopCounterMode(display=False)
    with counter, torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _ = fn(*args, **kwargs)
    return int(counter.get_total_flops()), sum(saved.values())


def _time(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], repeats: int) -> tuple[float, float]:
    """Median forward and backward seconds of one call.  The forward records autograd's
    graph when an input requires grad, as a training step's forward does (under no_grad
    it is 10-20% faster on small ops, which the step never sees)."""
    leaves = [a for a in _tensors((args, kwargs)) if a.requires_grad]
    with torch.set_grad_enabled(bool(leaves)):
        fn(*args, **kwargs)  # warm-up
        forward = _best(lambda: fn(*args, **kwargs), repeats)
    if not leaves:
        return forward, 0.0
    try:
        with torch.enable_grad():
            out = [t for t in _tensors(fn(*args, **kwargs)) if t.requires_grad]
            if not out:
                return forward, 0.0
            grads = [torch.ones_like(t) for t in out]

            def backward() -> None:
                torch.autograd.grad(out, leaves, grads, retain_graph=True, allow_unused=True)

            backward()  # warm-up
            return forward, _best(backward, repeats)
    except RuntimeError:  # in-place ops on leaves and the like: use the usual 2x
        return forward, BACKWARD_FLOP_FACTOR * forward


def _backward_overhead(repeats: int) -> float:
    """The fixed cost of starting one autograd.grad call, which a stage pays once per
    backward rather than once per node: measured on a one-element op and subtracted."""
    x = torch.ones(1, requires_grad=True)
    y = x * 1.0
    g = torch.ones(1)
    run = lambda: torch.autograd.grad([y], [x], [g], retain_graph=True)  # noqa: E731
    run()
    return _best(run, max(repeats, 9)) * 0.9


def _calibrate(gm: torch.fx.GraphModule, values: dict[torch.fx.Node, Any], costs: dict[str, NodeCost],
               repeats: int, wait_s: float = 0.0, min_s: float = 0.0) -> dict[str, NodeCost]:
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
        fwd, bwd = time_forward_backward(lambda: plain(*inputs), max(3 * repeats, 15), wait_s, min_s)
    except Exception:  # in-place ops on inputs, and whatever else only the whole graph meets
        return costs
    finally:
        for p, g in zip(params, saved):
            p.grad = g
    out = dict(costs)
    in_backward = [n.name for n in timed if _needs_grad(values.get(n))]
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


# [Note: compute after a wait]
#     A pipeline rank seldom computes back to back: before most forwards and backwards it
#     waits for a message.  On the CPU the compute that follows an idle runs slower than
#     the same compute looped: a stage of the GPT example 1.25-1.5x after sleeps of
#     0.5-2 ms, a BERT stage 1.2x after 0.2 ms, 1.35x after 1 ms, 1.55x after 3 ms and 1.8x
#     after 8 ms (our 2-core VM).  Why is not settled (caches and branch predictors
#     cooled by the threads that ran meanwhile are one candidate), but a profile taken
#     in a tight loop would underestimate every stage.  Where gloo's threads share the
#     cores (`Hardware.idle_before_compute_s`), each forward and backward is therefore
#     timed after idling one message's wait, the typical idle of a rank; longer stalls
#     in a real run still cost more than that (`compute_x` of benchmarks.simulator_error).


def time_forward_backward(forward: Callable[[], Any], samples: int, wait_s: float = 0.0,
                          min_s: float = 0.0) -> tuple[float, float]:
    """Median seconds of `forward()` (autograd recording) and of the backward from every
    floating output that needs a gradient (ones as their gradients), each after idling
    `wait_s`, over `samples` samples after one warm-up, and more until `min_s` seconds have
    passed: a stage's forward and backward as a rank runs them.
    `benchmarks/simulator_error.py` times the generated stages with it during the run, as
    the compile timed their graphs."""
    forwards: list[float] = []
    backwards: list[float] = []
    until = time.perf_counter() + min_s
    i = 0
    while i <= samples or time.perf_counter() < until:
        if wait_s:
            time.sleep(wait_s)
        start = time.perf_counter()
        with torch.enable_grad():
            outs = [t for t in _tensors(forward()) if t.requires_grad and (t.is_floating_point() or t.is_complex())]
        forwarded = time.perf_counter() - start
        grads = [torch.ones_like(t) for t in outs]
        if wait_s:
            time.sleep(wait_s)
        start = time.perf_counter()
        if outs:
            torch.autograd.backward(outs, grads)
        if i:  # the first is a warm-up
            forwards.append(forwarded)
            backwards.append(time.perf_counter() - start if outs else 0.0)
        i += 1
    return statistics.median(forwards), statistics.median(backwards)


def calibrate_stages(gm: torch.fx.GraphModule, values: dict[torch.fx.Node, Any], costs: dict[str, NodeCost],
                     stage_of: dict[str, int], repeats: int, wait_s: float,
                     ranks: Sequence[tuple[Sequence[int], set[int]]] = ()) -> dict[str, NodeCost]:
    """Node times made to add up to each stage's, run as a rank runs it.

    `_calibrate` on each stage's own graph: its inputs from other stages become leaves
    (as `runtime.stage.as_leaf` makes them), its outputs are what other stages read, and
    each forward and backward follows a `wait_s` idle, as a pipeline rank's do.  A stage
    costs more than its share of the whole graph's time: it starts autograd's engine on
    its own, and it pays the slow start after a wait once per stage, not once per model
    ([Note: compute after a wait]).  The plan is not changed, only its predicted times.

    `ranks`, one (stages, cores) per rank, calibrates the ranks side by side, as they
    compute ([Note: stages timed side by side]); without it the stages are timed one
    after the other in this process.
    """
    if ranks:
        return _calibrate_side_by_side(gm, values, costs, stage_of, repeats, wait_s, ranks)
    out = dict(costs)
    for stage in sorted(set(stage_of.values())):
        out = _calibrate(*_stage_graph(gm, values, _members(stage_of, stage)), out, repeats, wait_s, CALIBRATION_MIN_S)
    return out


def _members(stage_of: dict[str, int], stage: int) -> set[str]:
    return {name for name, s in stage_of.items() if s == stage}


class CalibrationError(RuntimeError):
    """Timing the stages side by side failed (a rank's process died or overran)."""


# [Note: stages timed side by side]
#     On one CPU machine the pipeline's ranks compute at the same time, each on its own
#     cores, and share the rest: the last-level cache and the memory bandwidth.  A stage
#     timed alone, the other cores idle, runs faster than it does beside the others: on
#     our 2-core VM the examples' stages at batch 192 ran 1.2-1.5x slower during a
#     2-rank run than the compile had timed them one at a time (`drift_x` of
#     benchmarks.simulator_error), and a matmul loop 1.1x slower beside another.  So each
#     rank gets a process of its own, forked, bound to the rank's cores and keeping freed
#     memory as a rank does (runtime/malloc.py); they start together, each times its stages, then keeps
#     running its last one until every rank has finished timing: every sample is taken
#     with the others computing, as in the schedule's steady state.  (The fill and drain
#     of the pipeline, where a rank computes alone, are then slightly overestimated.)


def _calibrate_side_by_side(gm: torch.fx.GraphModule, values: dict[torch.fx.Node, Any], costs: dict[str, NodeCost],
                            stage_of: dict[str, int], repeats: int, wait_s: float,
                            ranks: Sequence[tuple[Sequence[int], set[int]]]) -> dict[str, NodeCost]:
    ctx = multiprocessing.get_context("fork")  # the children share the graph and its values, copy-on-write
    start = ctx.Barrier(len(ranks))
    finished = ctx.Value("i", 0)
    pipes, children = [], []
    try:
        for stages, cores in ranks:
            mine, theirs = ctx.Pipe(duplex=False)
            child = ctx.Process(target=_time_rank, daemon=True,
                                args=(theirs, gm, values, costs, stage_of, list(stages), cores, repeats, wait_s,
                                      start, finished, len(ranks)))
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
               start: Any, finished: Any, ranks: int) -> None:
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
            out = _calibrate(sub, sub_values, out, repeats, wait_s, CALIBRATION_MIN_S)
        finish()
        while finished.value < ranks:  # beside the ranks still timing theirs
            _calibrate(*graphs[-1], costs, 1, wait_s)
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


def _best(call: Callable[[], Any], repeats: int) -> float:
    """Seconds per call: the fastest of `repeats` samples, each long enough to time.

    Other work on the machine only ever adds time, so the fastest sample is the best
    estimate of the op's own cost (as `timeit` advises); calls shorter than ~100 us are
    batched so a sample is not mostly timer overhead.
    """
    start = time.perf_counter()
    call()
    once = time.perf_counter() - start
    inner = max(1, min(50, int(1e-4 / max(once, 1e-7))))
    samples = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        for _ in range(inner):
            call()
        samples.append((time.perf_counter() - start) / inner)
    return min(samples)


# -- sizes -------------------------------------------------------------------------------


def _tensors(value: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    torch.fx.node.map_aggregate(value, lambda v: out.append(v) if isinstance(v, torch.Tensor) else None)
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _bytes(value: Any) -> int:
    return sum(_nbytes(t) for t in _tensors(value))


def _needs_grad(value: Any) -> bool:
    return any(t.requires_grad for t in _tensors(value))
