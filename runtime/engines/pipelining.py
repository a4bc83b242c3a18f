"""engine="pipelining": the package's stages run by torch.distributed.pipelining.

`runtime.DistributedPipeline(DIR, engine="pipelining")` is a `PipeliningPipeline`: the same
ranks, process groups, weights, checkpoints, clipping, optimizers and step checks as
DistributedPipeline (distributed.py), with steps 2-5 of its train_step done by torch:

    train_step on one rank:
      1. each of this rank's stages, wrapped (torch_stages.Adapter: [Note: stages in a
         chain]), and with dp > 1 in torch's DistributedDataParallel over its dp group, is a
         `PipelineStage` with static metadata from the manifest (torch_stages.RaggedStage: one
         set per microbatch sizes, each microbatch's receive buffers its own shape)
      2. the package's schedule runs as torch's class (torch_stages.SCHEDULE_CLASSES):
         forward, loss (/ our microbatch weights, scale_grads=False), backward, sends and
         receives, and DDP's all-reduce after each stage's last backward (an average)
      3. parameters shared by two stages of this rank (DDP cannot hold one parameter
         twice) are averaged over the replicas here; tied parameters across ranks sum their
         copies' gradients as DistributedPipeline does (comm.TiedGrads)
      4. the loss: the last stages' sums over the world, / dp

evaluate and pipe(inputs) run the same schedule forward only (torch's eval); pipe(inputs)
takes the last stage's outputs from its Adapter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import pipelining as pp
from torch.nn.parallel import DistributedDataParallel

from .. import package
from ..distributed import DistributedPipeline, _Step
from ..edges import edge_values
from ..errors import EngineError
from . import CLASSES
from ..pipeline import Batch
from ..schedule import Schedule, make_schedule
from ..stage import to_device
from .torch_stages import (LOWERED, SPLIT_BACKWARD, Adapter, Feed, RaggedStage, StageLoss, check_chain,
                           prepare_forward_only, schedule_class, stage_metas, torch_actions)

__all__ = ["PipeliningPipeline", "DistributedPipeline"]


class PipeliningPipeline(DistributedPipeline):
    """DistributedPipeline whose schedule torch.distributed.pipelining runs (engine="pipelining")."""

    engine = "pipelining"

    def __init__(self, directory: str | Path, *, engine: str = "pipelining", schedule: str | Schedule | None = None,
                 timeout_s: float | None = None, trace: str | Path | None = None) -> None:
        if schedule is not None:
            raise EngineError("engine='pipelining' runs the package's own schedule with torch's class: a schedule= "
                              "given here (a name or an action list) runs on engine='partitioner' only.")
        m = package.load_manifest(directory)
        self._schedule_cls, self._multi = schedule_class(m.schedule)  # before any rank joins a group
        check_chain(m)
        super().__init__(directory, timeout_s=timeout_s, trace=trace)
        self._buckets = None  # DDP reduces the replicas' gradients instead
        self._pp_group = self._make_pp_group()
        self._feed = Feed(m.source.seed, self.replica, m.microbatches)
        self._shared = self._shared_params()
        self._modules = {s: self._wrap(s) for s in self.stages}
        self._schedules: dict[tuple[tuple[int, ...], bool], Any] = {}

    # -- construction ----------------------------------------------------------------------------

    def _make_pp_group(self) -> Any:
        """This (replica, t)'s pipeline group, the positions in order (every rank makes every one)."""
        mine = None
        for r in range(self.dp):
            for u in range(self.tp):
                group = dist.new_group([self.mesh.rank(r, pos, u) for pos in range(self.pp)])
                if (r, u) == (self.replica, self.tp_index):
                    mine = group
        return mine

    def _shared_params(self) -> list[torch.nn.Parameter]:
        """With dp > 1, parameters that two stages of this rank share and no other rank holds
        (step 3 of the module's docstring)."""
        counts: dict[int, int] = {}
        for r in self.runners.values():
            for p in r.module.parameters():
                counts[id(p)] = counts.get(id(p), 0) + 1
        tied = {id(p) for name, p in self._module_named() if name in self.groups.ties}
        return [p for _, p in self._module_named()
                if self.dp > 1 and counts.get(id(p), 0) > 1 and id(p) not in tied and p.requires_grad]

    def _wrap(self, s: int) -> torch.nn.Module:
        """Stage s as torch's stage calls it; with dp > 1 in DDP over this rank's dp group,
        less the parameters reduced elsewhere (tied across ranks, shared in this rank)."""
        runner = self.runners[s]
        received = [o.name for o in edge_values(self.manifest, s - 1, s)] if s > 0 else []
        module = Adapter(runner, received, self._feed, self.device, self.manifest.schedule in SPLIT_BACKWARD)
        if self.dp == 1:
            return module
        elsewhere = {id(p) for p in self._shared} | {id(p) for n, p in self._module_named() if n in self.groups.ties}
        ignore = [f"stage.{n}" for n, p in runner.module.named_parameters() if id(p) in elsewhere]
        if len(ignore) == len(list(runner.module.parameters())):
            return module
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, ignore)
        return DistributedDataParallel(module, process_group=self.groups.dp, init_sync=False,
                                       forward_sync_buffers=False)

    def _schedule(self, batch: Batch, forward: bool = False) -> Any:
        """torch's schedule for this batch's microbatch count and size, made once (forward:
        the one evaluate and pipe(inputs) run)."""
        key = (tuple(batch.rows), forward)
        if key not in self._schedules:
            self._schedules[key] = self._make_schedule(batch.rows, forward)
        return self._schedules[key]

    def _make_schedule(self, rows: list[int], forward: bool = False) -> Any:
        """torch's schedule class over new PipelineStages; our action list on torch's runtime
        where torch has no class (zb-h2).  Forward only (evaluate, pipe(inputs)): GPipe's
        forwards, or on several stages per rank `prepare_forward_only` on torch's runtime."""
        m, num, count = self.manifest, len(self.manifest.stages), len(rows)
        stages = [RaggedStage(self._modules[s], s, num, self.device, group=self._pp_group,
                              shapes=[stage_metas(m, s, r) for r in rows]) for s in self.stages]
        loss = None if forward else StageLoss(self.runners.get(num - 1), self._feed, self.device)
        cls: type[Any] = (LOWERED if self._multi else pp.ScheduleGPipe) if forward else self._schedule_cls
        schedule: Any = cls(stages if self._multi else stages[0], n_microbatches=count, loss_fn=loss, scale_grads=False)
        if forward and self._multi:
            prepare_forward_only(schedule, {s: self.graph.rank_of(s) for s in range(num)}, count)
        elif cls is LOWERED:
            ours = make_schedule(m.schedule, self.pp, count, m.virtual_stages)
            schedule._prepare_schedule_with_comms(torch_actions(ours))
        return schedule

    # -- the steps (hooks of pipeline.py) --------------------------------------------------------

    def _start(self, batch: Batch, targets: bool, forward: bool = False) -> tuple[Any, torch.Tensor | None]:
        """This step's schedule, its microbatches given to the stages, and the target that
        carries each microbatch's index to the loss ([Note: microbatch order])."""
        schedule = self._schedule(batch, forward)
        self._feed.start(self._steps.call, batch.inputs[self.replica],
                         batch.targets.get(self.replica) if targets else None, batch.scales,
                         batch.loss_fn if targets else None)
        last = any(r.is_last for r in self.runners.values())
        return schedule, (torch.arange(batch.count) if last else None)

    def _run_train(self, batch: Batch) -> torch.Tensor:
        schedule, index = self._start(batch, True)
        snapshot = self._ties.snapshot()
        losses: list[torch.Tensor] = []
        try:
            with self.tracer.span("torch.distributed.pipelining step", self.stages[0], "schedule", 0):
                schedule.step(target=index, losses=losses, return_outputs=False)
            self._average_shared()
            with self.tracer.collective("tied gradient all_reduce"):
                self._ties.reduce(snapshot)
            if self._masters is not None:
                self._masters.take_grads()
            loss = self._reduce_loss(_Step(train=True, loss=_summed(losses)))
        finally:
            for r in self.runners.values():
                r.clear()
        self.tracer.flush()
        return loss

    def _run_evaluate(self, batch: Batch) -> torch.Tensor:
        """The forwards, then the last stage's losses from its outputs."""
        outputs = self._forward_only(batch, True)
        last = self.runners.get(len(self.manifest.stages) - 1)
        losses = []
        if last is not None and outputs:
            targets, fn = batch.targets[self.replica], batch.loss_fn
            assert fn is not None
            losses = [last.scaled_loss(o, to_device(targets[i], self.device), fn, batch.scales[i])
                      for i, o in enumerate(outputs)]
        loss = self._reduce_loss(_Step(train=False, evaluate=True, loss=_summed(losses)))
        self.tracer.flush()
        return loss

    def _run_forward(self, batch: Batch) -> list[Any]:
        """Every replica's outputs (local rows: this replica's), from the last stage's ranks."""
        outputs = self._forward_only(batch, False)
        last = self.graph.rank_of(self.graph.num_stages - 1)
        mine = ([to_device(o, torch.device("cpu")) for o in outputs]
                if self.position == last and self.tp_index == 0 else None)
        gathered = self._gather_outputs(mine)
        replicas = [self.replica] if batch.local else range(self.dp)
        return [o for r in replicas for o in gathered[self.mesh.rank(r, last, 0)]]

    def _forward_only(self, batch: Batch, targets: bool) -> list[Any]:
        """The forward-only schedule; the last stage's outputs ([] on other ranks)."""
        schedule, _ = self._start(batch, targets, forward=True)
        self._feed.outputs = []
        try:
            schedule.step(return_outputs=False)
            return self._feed.outputs
        finally:
            self._feed.outputs = None

    def _average_shared(self) -> None:
        """Step 3: the shared parameters' gradients averaged over the replicas."""
        for p in self._shared:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.groups.dp)
                p.grad.div_(self.dp)

    def _recover_ranks(self) -> None:
        """After a failed step: torch's schedules are made again (they keep a step's state)."""
        self._schedules.clear()
        super()._recover_ranks()


CLASSES["pipelining"] = PipeliningPipeline


def _summed(losses: list[torch.Tensor]) -> torch.Tensor | None:
    """The microbatches' (weighted) losses summed, detached; None on a rank without the last stage."""
    return torch.stack([x.detach() for x in losses]).sum() if losses else None
