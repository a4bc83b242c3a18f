"""Annotate: a `NodeCost` for every compute node, returned by node name (the one place
costs live: every later pass reads and returns that dict).

Two sources, one result type:

- `profile`: measured on this machine.  Each node is re-run in isolation on its real
  microbatch inputs: forward (with autograd recording, as in training) and backward timed
  `repeats` times (the fastest sample), FLOPs from `torch.utils.flop_counter.FlopCounterMode`,
  activation bytes from the tensors autograd saves for backward
  (`torch.autograd.graph.saved_tensors_hooks`), parameters excluded, and where the device
  counts its allocations (CUDA) the peak memory of its forward and backward.  Every time and
  peak is taken through the device's timer (`timer.py`: CUDA events on a GPU, the wall
  clock on the CPU); on the CPU the nodes run in a forked child, where one that crashes the
  process is costed as `estimate` costs it ([Note: a profiled op that crashes] in guard.py).
  The node times are then calibrated against the whole graph run as one forward and one
  backward (`calibrate.calibrate_graph`): what isolation misses (the generated forward's own
  dispatch, the autograd engine walking one graph, gradient accumulation) is spread over
  the nodes, so the sum of a stage's node times is what the stage takes.
- `estimate`: analytic, from the same FLOP count and the bytes the op reads and writes,
  through the roofline of a hardware profile (`roofline.py`).  Deterministic, so golden
  tests and CI use it.  On the meta device (a model too large to run here) every tensor
  is a shape, so the FLOPs and saved bytes of equal calls (the same op in identical
  layers) are counted once, and attention saves what a fused kernel saves (`_flash_saved`).
"""

from __future__ import annotations

import contextlib
import math
import sys
from typing import Any, Callable, Generator, Hashable, Iterable

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from runtime.split_backward import weight_inputs

from ..ir import NodeCost
from .calibrate import calibrate_graph
from .guard import Crashed, can_guard, guarded
from .hardware import Hardware
from .nodes import compute_dtype, compute_nodes, is_shape_only, nbytes, needs_grad, param_names, storage_key, tensors, total_bytes
from .roofline import BACKWARD_FLOP_FACTOR, roofline_s
from .timer import CPU_TIMER, DeviceTimer
from .waves import node_fraction, output_shape

__all__ = ["PROFILE_VERSION", "annotate"]

#: what a measured profile means; part of a profile cache key, so that profiles measured
#: by older code (forward under no_grad, no whole-graph calibration, calibration without
#: the wait before each pass) are measured again
PROFILE_VERSION = 6  # 6: the weight gradient's part of each backward (NodeCost.weight_fraction)


def _warn(line: str) -> None:
    print(line, file=sys.stderr)


def annotate(
    gm: torch.fx.GraphModule,
    values: dict[torch.fx.Node, Any],
    hardware: Hardware,
    measure: bool,
    repeats: int = 5,
    progress: Callable[[Iterable[torch.fx.Node]], Iterable[torch.fx.Node]] = iter,
    wait_s: float = 0.0,
    timer: DeviceTimer = CPU_TIMER,
    say: Callable[[str], None] = _warn,
) -> dict[str, NodeCost]:
    """The cost of every compute node, by node name.
    `wait_s`: how long a pipeline stage idles before each forward and backward (waiting
    for its input), which the calibration reproduces; see [Note: compute after a wait] in calibrate.py.
    `timer`: the timer of the device `values` live on, which times every measurement.
    `say`: told, in one line each, of a node whose profiling crashed the process and
    which is costed analytically instead ([Note: a profiled op that crashes] in guard.py)."""
    params = {name: p for name, p in gm.named_parameters(remove_duplicate=False)}
    param_storages = {storage_key(p) for p in params.values()}
    nodes = list(compute_nodes(gm))
    calls = [_bind(node, values) for node in nodes]
    counts = _counts(nodes, calls, values, param_storages, iter if measure else progress)
    roles = [_differentiable(args, kwargs, param_storages) for _, args, kwargs in calls]
    timings: list[_Timing | Crashed | None] = ([*_timings(nodes, calls, roles, repeats, timer, progress)] if measure
                                               else [None] * len(nodes))
    costs: dict[str, NodeCost] = {}
    for node, (fn, args, kwargs), (flops, activation), (weights, inputs), timing in zip(nodes, calls, counts, roles,
                                                                                         timings):
        if isinstance(timing, Crashed):
            say(f"warning: profiling node %{node.name} ({_what(node)}) crashed the process ({timing.how}); "
                f"its cost is analytic (the roofline of {hardware.name})")
        if isinstance(timing, tuple):
            fwd, bwd, fraction, peak = timing
        else:
            (fwd, bwd), peak = _analytic(node, values, args, kwargs, flops, bool(weights), hardware), None
            fraction = _weight_fraction(weights, inputs, bwd / 2, bwd)  # dW and dX: a matmul each
        costs[node.name] = NodeCost(
            name=node.name,
            forward_s=fwd,
            backward_s=bwd,
            flops=flops,
            param_bytes=sum(nbytes(params[p]) for p in param_names(node, set(params))),
            activation_bytes=activation,
            output_bytes=total_bytes(values.get(node)),
            weight_fraction=fraction,
            peak_bytes=peak,
        )
    if measure:
        costs = calibrate_graph(gm, values, costs, repeats, wait_s, timer=timer)
    return costs


#: one node's measurement: forward and backward seconds, the weights' part of the backward,
#: and its peak bytes where the device counts them
_Timing = tuple[float, float, float, "int | None"]


def _counts(nodes: list[torch.fx.Node], calls: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]],
            values: dict[torch.fx.Node, Any], param_storages: set[int],
            progress: Callable[[Iterable[torch.fx.Node]], Iterable[torch.fx.Node]]) -> list[tuple[int, int]]:
    """Each node's forward FLOPs and the bytes it saves for backward, equal calls on shape-only
    tensors counted once (`_meta_signature`)."""
    seen: dict[Hashable, tuple[int, int]] = {}
    out = []
    for node, (fn, args, kwargs) in zip(progress(nodes), calls):
        key = _meta_signature(node, args, kwargs, param_storages)
        if key is None or key not in seen:
            found = _flops_and_saved(fn, args, kwargs, param_storages)
            flash = _flash_saved(node, args, values.get(node))
            found = found if flash is None else (found[0], flash)
            if key is not None:
                seen[key] = found
        out.append(seen[key] if key is not None else found)
    return out


def _timings(nodes: list[torch.fx.Node], calls: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]],
             roles: list[tuple[list[torch.Tensor], list[torch.Tensor]]], repeats: int, timer: DeviceTimer,
             progress: Callable[[Iterable[torch.fx.Node]], Iterable[torch.fx.Node]]) -> list[_Timing | Crashed]:
    """Each node timed in isolation (`_time`, `_peak`): on one CPU thread in a forked child,
    where a node that crashes it is `Crashed` ([Note: a profiled op that crashes] in guard.py)."""
    overhead = _backward_overhead(repeats, timer)

    def work(i: int) -> _Timing:
        (fn, args, kwargs), (weights, inputs) = calls[i], roles[i]
        fwd, bwd, weight = _time(fn, args, kwargs, repeats, weights if inputs else [], timer)
        bwd = max(0.0, bwd - overhead) if bwd else 0.0
        fraction = _weight_fraction(weights, inputs, max(0.0, weight - overhead), bwd)
        return fwd, bwd, fraction, _peak(fn, args, kwargs, timer) if timer.counts_memory else None

    results: Generator[_Timing | Crashed, None, None] = (
        guarded(len(calls), work) if not timer.is_cuda and torch.get_num_threads() == 1 and can_guard()
        else (work(i) for i in range(len(calls))))
    with contextlib.closing(results):
        return [timing for _, timing in zip(progress(nodes), results)]


def _analytic(node: torch.fx.Node, values: dict[torch.fx.Node, Any], args: tuple[Any, ...], kwargs: dict[str, Any],
              flops: int, weighted: bool, hardware: Hardware) -> tuple[float, float]:
    """A node's forward and backward seconds by the roofline of `hardware`."""
    rate = hardware.peak_for(compute_dtype(values.get(node), (args, kwargs)))  # [Note: a peak per dtype]
    if flops:  # [Note: waves of tiles]
        rate *= node_fraction(output_shape(values.get(node)), weighted, hardware)
    moved = total_bytes(args) + total_bytes(kwargs) + total_bytes(values.get(node))
    fwd = roofline_s(flops, moved, rate, hardware.memory_bandwidth, hardware.efficiency)
    return fwd, BACKWARD_FLOP_FACTOR * fwd if needs_grad(values.get(node)) else 0.0


def _what(node: torch.fx.Node) -> str:
    """The op a node calls, for a message."""
    target = node.target
    return str(target) if isinstance(target, str) else getattr(target, "__name__", None) or str(target)


# -- running one node --------------------------------------------------------------------


def _bind(node: torch.fx.Node, values: dict[torch.fx.Node, Any]) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    """The node as a plain call on fresh autograd leaves that share the real storage.

    [Note: profiling in-place ops] A node that writes an input in place (`relu_` from
    `ReLU(inplace=True)`, `out += identity`, a router's `/=`, BatchNorm's
    `num_batches_tracked += 1`, T5's `relative_buckets += ...`) may not run on a leaf that
    requires grad, and run again and again on the stored value it would change the values
    later nodes are profiled on (T5's bucket ids grew past the embedding).  So the
    arguments it writes (`node.meta["writes"]`, recorded by trace.passes.propagate) are
    cloned at every call: a non-leaf of the leaf, fresh storage each time.  The clone is
    timed with the op, as the copy's few bytes per element are small beside the op."""

    def leaf(n: torch.fx.Node) -> Any:
        v = values[n]
        if isinstance(v, torch.Tensor):
            return v.detach().requires_grad_(v.requires_grad)
        return v

    args = tuple(torch.fx.node.map_arg(node.args, leaf))
    kwargs = dict(torch.fx.node.map_arg(node.kwargs, leaf))
    if node.op == "call_method":
        name = str(node.target)
        fn: Callable[..., Any] = lambda self, *a, **k: getattr(self, name)(*a, **k)  # noqa: E731
    else:
        fn = node.target  # type: ignore[assignment]
    written = _written_positions(node, values)
    if not written:
        return fn, args, kwargs
    return _cloning(fn, written), args, kwargs


def _written_positions(node: torch.fx.Node, values: dict[torch.fx.Node, Any]) -> set[int]:
    """Positions, among the bound call's flattened (args, kwargs), of the tensors the node
    writes in place."""
    writes = set(node.meta.get("writes", ()))
    if not writes:
        return set()
    mark: Any = object()
    bound = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: mark if n.name in writes else values[n])
    flat, _ = pytree.tree_flatten(bound)
    return {i for i, v in enumerate(flat) if v is mark}


def _cloning(fn: Callable[..., Any], written: set[int]) -> Callable[..., Any]:
    """`fn` with the flat arguments at `written` cloned at each call ([Note: profiling in-place ops])."""

    def call(*args: Any, **kwargs: Any) -> Any:
        flat, spec = pytree.tree_flatten((args, kwargs))
        flat = [v.clone() if i in written and isinstance(v, torch.Tensor) else v for i, v in enumerate(flat)]
        a, k = pytree.tree_unflatten(flat, spec)
        return fn(*a, **k)

    return call


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
            if not is_shape_only(value):
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
    qkvo = [t for t in (q, k, v, out) if isinstance(t, torch.Tensor)]
    if len(qkvo) != 4 or not all(is_shape_only(t) and t.dim() == 4 for t in qkvo):
        return None
    rows = math.prod(int(d) for d in q.shape[:3])  # type: ignore[union-attr]
    return sum(nbytes(t) for t in qkvo) + 4 * rows


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


def _differentiable(args: tuple[Any, ...], kwargs: dict[str, Any], param_storages: set[int]
                    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The call's arguments that need a gradient: (parameters, the others)."""
    leaves = [a for a in tensors((args, kwargs)) if a.requires_grad]
    weights = [a for a in leaves if storage_key(a) in param_storages]
    return weights, [a for a in leaves if storage_key(a) not in param_storages]


def _weight_fraction(weights: list[torch.Tensor], inputs: list[torch.Tensor], weight_s: float, backward_s: float
                     ) -> float:
    """The part of a node's backward that is its weights' gradient: none or all of it where
    only other inputs or only weights need one, else `weight_s` of `backward_s` (half
    where the backward is too short to time)."""
    if not weights:
        return 0.0
    if not inputs:
        return 1.0
    return min(1.0, weight_s / backward_s) if backward_s > 0 else 0.5


def _time(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], repeats: int,
          weights: list[torch.Tensor], timer: DeviceTimer) -> tuple[float, float, float]:
    """Median forward and backward seconds of one call, and with `weights`, the seconds of
    the weights' gradient alone (a zero-bubble W, as the runtime runs it).  The forward records autograd's graph
    when an input requires grad, as a training step's forward does (under no_grad it is
    10-20% faster on small ops, which the step never sees)."""
    leaves = [a for a in tensors((args, kwargs)) if a.requires_grad]
    with torch.set_grad_enabled(bool(leaves)):
        fn(*args, **kwargs)  # warm-up
        forward = _best(lambda: fn(*args, **kwargs), repeats, timer)
    if not leaves:
        return forward, 0.0, 0.0
    try:
        with torch.enable_grad():
            out = [t for t in tensors(fn(*args, **kwargs)) if t.requires_grad]
            if not out:
                return forward, 0.0, 0.0
            grads = [torch.ones_like(t) for t in out]

            def backward(of: list[Any]) -> Callable[[], Any]:
                return lambda: torch.autograd.grad(out, of, grads, retain_graph=True, allow_unused=True)

            backward(leaves)()  # warm-up
            whole = _best(backward(leaves), repeats, timer)
            if not weights:
                return forward, whole, 0.0
            # W as the runtime runs it: [Note: a weight-only group norm backward] in runtime/split_backward.py
            return forward, whole, _best(backward(weight_inputs(out, weights)), repeats, timer)
    except RuntimeError:  # in-place ops on leaves and the like: use the usual 2x, half of it W
        return forward, BACKWARD_FLOP_FACTOR * forward, forward


def _peak(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], timer: DeviceTimer) -> int | None:
    """The allocator's peak above what was allocated before, while the node runs forward
    and backward once (its output, what it saves, its gradients and the op's workspace),
    where the device counts it; None where it does not, or where the backward fails as in
    `_time`."""
    def run() -> None:
        with torch.enable_grad():
            leaves = [a for a in tensors((args, kwargs)) if a.requires_grad]
            out = [t for t in tensors(fn(*args, **kwargs)) if t.requires_grad]
            if leaves and out:
                torch.autograd.grad(out, leaves, [torch.ones_like(t) for t in out], allow_unused=True)

    try:
        return timer.peak_bytes(run)
    except RuntimeError:
        return None


def _backward_overhead(repeats: int, timer: DeviceTimer) -> float:
    """The fixed cost of starting one autograd.grad call, which a stage pays once per
    backward rather than once per node: measured on a one-element op and subtracted."""
    x = torch.ones(1, requires_grad=True, device=timer.device)
    y = x * 1.0
    g = torch.ones(1, device=timer.device)
    run = lambda: torch.autograd.grad([y], [x], [g], retain_graph=True)  # noqa: E731
    run()
    return _best(run, max(repeats, 9), timer) * 0.9


def _best(call: Callable[[], Any], repeats: int, timer: DeviceTimer) -> float:
    """Seconds per call on the timer's device: the fastest of `repeats` samples, each long
    enough to time.

    Other work on the machine only ever adds time, so the fastest sample is the best
    estimate of the op's own cost (as `timeit` advises); calls shorter than ~100 us are
    batched so a sample is not mostly timer overhead.
    """
    once = timer.time(call)
    inner = max(1, min(50, int(1e-4 / max(once, 1e-7))))

    def batch() -> None:
        for _ in range(inner):
            call()

    return min(timer.time(batch) / inner for _ in range(max(1, repeats)))

