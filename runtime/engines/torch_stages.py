"""The package's stages as torch.distributed.pipelining sees them: one module per stage that
takes what the previous stage sends, the stage metadata, and the schedule classes.

[Note: stages in a chain]
    torch's PipelineStage receives from stage k-1 only and sends to stage k+1 only, every
    output of stage k being the positional inputs of stage k+1 in order.  A package runs on
    it when every value between stages goes from k to k+1 alone (`check_chain`); a value
    that skips stages (a skip connection cut by the plan) cannot be carried and is refused
    with the partitioner engine named.  Model inputs are not sent: each stage's `Adapter`
    reads the ones it needs from the step's microbatches (`Feed`), as our runtime does.

[Note: microbatch order]
    torch calls a stage's forward, and the last stage's loss, with no microbatch index.
    Every schedule torch has runs a stage's forwards in microbatch order 0, 1, ..., M-1, so
    the `Feed` counts them per stage; the loss is given the microbatch index as its
    "target" (torch splits `arange(M)` into M one-element chunks) and looks up the real
    target and its weight ([Note: microbatch weights] in microbatches.py) from the `Feed`.

[Note: outputs under split backward]
    torch's input-gradient step (I) ends by detaching the stage's outputs in place, to free
    their graph; a view cannot be detached in place, and an output the stage also used
    inside (a value saved for backward) would be lost to W.  Under the zero-bubble
    schedules the Adapter therefore returns a copy of each output: the same values and
    gradients, one copy per output and microbatch.

[Note: structured model outputs]
    torch's stage handles tensors and tuples of them; a model's output may be a structure (a
    Hugging Face `ModelOutput`, a dict).  The last stage's Adapter returns its leaves as a
    tuple and keeps the structure in the `Feed`; the `StageLoss` puts it back together, so
    `loss_fn` sees the output the original model returns.

Beside torch's public classes this module uses `_PipelineScheduleRuntime`, `_Action` and
`_add_send_recv` (torch 2.13): where torch changes them, `torch_actions` and
`prepare_forward_only` are the two places to follow it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch.distributed import pipelining as pp
from torch.distributed.pipelining.schedules import (_Action, _add_send_recv, _ComputationType,
                                                   _PipelineScheduleRuntime)

from .. import modes
from ..edges import dtype_of, edge_values, value_shape
from ..errors import EngineError
from ..manifest import Manifest
from ..schedule import Kind, Schedule
from ..stage import StageRunner, to_device

__all__ = ["SCHEDULE_CLASSES", "SPLIT_BACKWARD", "LOWERED", "Adapter", "Feed", "RaggedStage", "StageLoss",
           "check_chain", "prepare_forward_only", "schedule_class", "stage_metas", "torch_actions"]

#: our schedule name -> torch's class; a multi-stage class takes the list of this rank's stages.
#: zb-h2 has none: our own action list runs on torch's `_PipelineScheduleRuntime` (`torch_actions`)
SCHEDULE_CLASSES: dict[str, tuple[type[Any], bool]] = {
    "gpipe": (pp.ScheduleGPipe, False),
    "1f1b": (pp.Schedule1F1B, False),
    "interleaved": (pp.ScheduleInterleaved1F1B, True),
    "zb-h1": (pp.ScheduleInterleavedZeroBubble, True),
    "zb-v": (pp.ScheduleZBVZeroBubble, True),
    "zb-h2": (_PipelineScheduleRuntime, True),
}
SPLIT_BACKWARD = ("zb-h1", "zb-h2", "zb-v")
LOWERED = _PipelineScheduleRuntime  # the class that runs an action list given to it
_KINDS = {Kind.F: _ComputationType.FORWARD, Kind.B: _ComputationType.FULL_BACKWARD,
          Kind.I: _ComputationType.BACKWARD_INPUT, Kind.W: _ComputationType.BACKWARD_WEIGHT}


def torch_actions(schedule: Schedule) -> dict[int, list[Any]]:
    """Our compute schedule (one row per pipeline rank) as torch's actions; torch adds the
    sends and receives (`_PipelineScheduleRuntime._prepare_schedule_with_comms`)."""
    return {r: [_Action(a.stage, _KINDS[a.kind], a.microbatch) for a in row if a.kind in _KINDS]
            for r, row in enumerate(schedule)}


def prepare_forward_only(schedule: Any, rank_of: dict[int, int], count: int) -> None:
    """Forward only on several stages per rank: each rank runs its stages in order, every
    microbatch of one before the next, on torch's runtime (torch's eval of a V asks for a
    backward, and its schedule check wants one: this order is set without that check)."""
    ranks = sorted(set(rank_of.values()))
    actions = {r: [_Action(s, _ComputationType.FORWARD, i) for s in sorted(rank_of) if rank_of[s] == r
                   for i in range(count)] for r in ranks}
    schedule.stage_index_to_group_rank = dict(rank_of)
    for stage in schedule._stages:
        stage.stage_index_to_group_rank = dict(rank_of)
    schedule.pipeline_order_with_comms = _add_send_recv(actions, lambda s: rank_of[s], len(rank_of))


def schedule_class(name: str) -> tuple[type[Any], bool]:
    """torch's class for schedule `name`, and whether it takes several stages; an EngineError
    naming the engine that runs the others."""
    if name not in SCHEDULE_CLASSES:
        raise EngineError(f"schedule {name!r} has no torch.distributed.pipelining class, so engine='pipelining' "
                          f"cannot run this package (it runs {', '.join(SCHEDULE_CLASSES)}): run it with "
                          f"engine='partitioner', or compile it with one of those schedules.")
    return SCHEDULE_CLASSES[name]


def check_chain(manifest: Manifest) -> None:
    """Every value between stages goes from stage k to stage k+1 only ([Note: stages in a chain])."""
    for stage in manifest.stages:
        for out in stage.outputs:
            if out.to != "output" and list(out.to) != [stage.index + 1]:
                raise EngineError(
                    f"stage {stage.index}'s output {out.name!r} goes to stages {list(out.to)}, but "
                    f"torch.distributed.pipelining sends a stage's outputs to the next stage only, so "
                    f"engine='pipelining' cannot carry it: run this package with engine='partitioner', or "
                    f"compile the model with another number of stages.")
        for spec in stage.inputs:
            if spec.source != "input" and spec.source != stage.index - 1:
                raise EngineError(
                    f"stage {stage.index} reads {spec.name!r} from stage {spec.source}, which is not the "
                    f"stage before it: engine='pipelining' cannot carry it ([Note: stages in a chain]); run this "
                    f"package with engine='partitioner'.")


def stage_metas(manifest: Manifest, s: int, rows: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Stage s's received values and sent values for a microbatch of `rows` rows, as meta
    tensors (torch's static stage metadata: nothing inferred at run time)."""
    def metas(specs: list[Any]) -> tuple[torch.Tensor, ...]:
        return tuple(torch.empty(value_shape(spec, rows, manifest), dtype=dtype_of(spec), device="meta")
                     .requires_grad_(bool(spec.requires_grad) and dtype_of(spec).is_floating_point) for spec in specs)
    stage = manifest.stages[s]
    received = metas(edge_values(manifest, s - 1, s)) if s > 0 else ()
    sent = metas(edge_values(manifest, s, s + 1)) if not stage.is_last else (torch.empty(0, device="meta"),)
    return received, sent


class RaggedStage(pp.PipelineStage):
    """torch's PipelineStage whose receive buffers follow each microbatch's rows: torch makes
    every microbatch's buffers from one shape, so a batch the count does not divide evenly
    (a short last batch) gets each microbatch's own shapes here ([Note: free batch])."""

    def __init__(self, module: torch.nn.Module, index: int, count: int, device: torch.device, *, group: Any,
                 shapes: list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]) -> None:
        super().__init__(module, index, count, device, input_args=shapes[0][0], output_args=shapes[0][1], group=group)
        self._shapes = shapes  # per microbatch: (received, sent) meta tensors (`stage_metas`)

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[Any]:
        """None on the last stage, which sends nothing: torch looks a destination up for each
        value it returns, and the model's output has a leaf for each field (a tuple, a
        dataclass: [Note: output classes] in partitioner/trace/outputs.py) where the last
        stage declares one placeholder (`stage_metas`)."""
        return [] if self.is_last else super().get_fwd_send_ops(fwd_chunk_id)

    def _setup_forward_recv_info(self, num_microbatches: int, has_backward: bool) -> None:
        super()._setup_forward_recv_info(num_microbatches, has_backward)
        if not self.is_first:
            for i in range(num_microbatches):
                _resize(self.args_recv_info[i], self._shapes[i][0], self.device)

    def _setup_backward_recv_info(self, num_microbatches: int) -> None:
        super()._setup_backward_recv_info(num_microbatches)
        for i in range(num_microbatches):
            _resize(self.grad_recv_info.get(i, ()), self._shapes[i][1], self.device)


def _resize(infos: Any, metas: tuple[torch.Tensor, ...], device: torch.device) -> None:
    """Each receive buffer of `infos` made anew with the shape of its meta tensor."""
    for info, meta in zip(infos, metas):
        if info.buffer is not None and tuple(info.buffer.shape) != tuple(meta.shape):
            info.buffer = torch.empty(meta.shape, dtype=info.buffer.dtype, device=device)


@dataclass
class Feed:
    """What one step's stages read besides what they receive: this replica's microbatch
    inputs and targets, their weights, the dropout seeds ([Note: microbatch order])."""

    seed: int
    replica: int
    microbatches: int
    call: int = 0
    inputs: list[dict[str, Any]] = field(default_factory=list)
    targets: list[Any] | None = None
    scales: list[float] = field(default_factory=list)
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    outputs: list[Any] | None = None  # pipe(inputs): the last stage's outputs, kept by its Adapter
    output_spec: pytree.TreeSpec | None = None  # the model output's structure ([Note: structured model outputs])
    _next: dict[int, int] = field(default_factory=dict)

    def start(self, call: int, inputs: list[dict[str, Any]], targets: list[Any] | None, scales: list[float],
              loss_fn: Callable[[Any, Any], torch.Tensor] | None) -> None:
        """A new step: its microbatches, and every stage's count back at 0."""
        self.call, self.inputs, self.targets, self.scales, self.loss_fn = call, inputs, targets, scales, loss_fn
        self._next.clear()

    def take(self, stage: int) -> int:
        """The microbatch of stage `stage`'s next forward."""
        i = self._next.get(stage, 0)
        self._next[stage] = i + 1
        return i

    def seed_of(self, stage: int, i: int) -> int:
        """The dropout seed of stage `stage`, microbatch i ([Note: dropout streams] in modes.py)."""
        return modes.microbatch_seed(self.seed, self.call, stage, self.replica * self.microbatches + i)


class Adapter(torch.nn.Module):
    """One generated stage as torch's PipelineStage calls it: positional received values in,
    the stage's outputs (a tuple; the model's output on the last stage) out.  The stage module
    is its child `stage`, so its parameters are this module's (for DDP)."""

    def __init__(self, runner: StageRunner, received: list[str], feed: Feed, device: torch.device,
                 split: bool = False) -> None:
        super().__init__()
        self.stage = runner.module
        self._runner, self._received, self._feed, self._device = runner, received, feed, device
        self._split = split  # the schedule splits backward in I and W

    def forward(self, *values: torch.Tensor) -> Any:
        runner, feed = self._runner, self._feed
        i = feed.take(runner.index)
        got = dict(zip(self._received, (_Contiguous.apply(v) if v.requires_grad else v for v in values)))
        args = [to_device(feed.inputs[i][spec.name], self._device) if spec.source == "input" else got[spec.name]
                for spec in runner.entry.inputs]
        train = torch.is_grad_enabled()
        out = runner.forward(i, args, train, feed.seed_of(runner.index, i))
        runner.forget(i)  # torch keeps the graph
        if runner.is_last:
            if feed.outputs is not None:
                feed.outputs.append(out)
            if isinstance(out, torch.Tensor):
                return out
            leaves, feed.output_spec = pytree.tree_flatten(out)  # [Note: structured model outputs]
            return tuple(leaves)
        if not self._split:
            return out
        # [Note: outputs under split backward]
        return tuple(o.clone() if isinstance(o, torch.Tensor) else o for o in out)


class _Contiguous(torch.autograd.Function):
    """The identity, whose gradient is made contiguous: torch's stage sends a received value's
    gradient as autograd made it, and a send takes only a contiguous tensor (a transposed or
    expanded use of the value gives a strided gradient)."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor) -> torch.Tensor:
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


@dataclass
class StageLoss:
    """The last stage's loss for torch's schedule: given the microbatch index as the target
    ([Note: microbatch order]), `loss_fn(output, target_i) / scale_i` as our runtime's."""

    runner: StageRunner | None  # None on a rank without the last stage (never called there)
    feed: Feed
    device: torch.device

    def __call__(self, output: Any, index: torch.Tensor) -> torch.Tensor:
        i, feed = int(index.reshape(-1)[0]), self.feed
        if feed.loss_fn is None or feed.targets is None or self.runner is None:  # pipe(inputs): no loss
            return torch.zeros((), device=self.device)
        target = to_device(feed.targets[i], self.device)
        if not isinstance(output, torch.Tensor) and feed.output_spec is not None:  # [Note: structured model outputs]
            output = pytree.tree_unflatten(list(output), feed.output_spec)
        return self.runner.scaled_loss(output, target, feed.loss_fn, feed.scales[i])
