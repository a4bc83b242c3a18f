"""`LocalPipeline`: every stage of a package in this one process (the user-facing contract: README.md, "Use").

For tests, debugging and one machine: it interprets the same schedule IR as the
distributed runtime, in the serial order `schedule.validate` simulates, so the
microbatch order, the gradient sums and the loss scaling are exactly those of a real
run.  SEND/RECV actions are no-ops here: values stay in memory (moved between devices
when stages sit on different GPUs).

A package compiled with tp = T > 1 runs as T lanes: lane t is a full copy of every
stage holding tensor-parallel index t's shards (as rank t of a distributed group
would), and the lanes' tp.* collectives meet in process (tp.Lanes, [Note: lanes] in
lanes.py).  With tp = 1 there is one lane, run in the calling thread.  CPU only when T > 1.

    train_step, per replica r of mesh.dp (run one after the other here):
      1. split the batch: replica r's rows, then M microbatches     (microbatches.split_inputs)
      2. in each lane t (a thread per lane, lane 0 in this one; joined, and the first
         lane's failure re-raised), for each (rank, action) of the simulated grid:
           F  stage s, microbatch i: read inputs from the batch or earlier stages'
              outputs as fresh leaves; the last stage adds loss_fn(out, t_i) / (M*dp)
           B  stage s, microbatch i: output grads = SUM of the readers' input grads;
              autograd.backward; keep this stage's input grads for its producers
           I  as B, input grads only;  W  the weight grads ([Note: split backward] in stage.py)
      3. the loss returned is the sum of the scaled microbatch losses (lane 0's; every
         lane computes the same)
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.utils._pytree as pytree

from . import checkpoint, clip, modes, offload, package, precision, tp
from .comm import timeout_from_env
from .counts import Counts
from .devices import DeviceLike, StageStreams, resolve_devices
from .errors import PipelineError
from .manifest import Manifest, StageInput, StageOutput
from .microbatches import concat_outputs
from .pipeline import Batch, LossFn, Pipeline, named_once
from .schedule import Action, Kind, Schedule, StageGraph, execution_order, lower, make_schedule, validate
from .stage import StageRunner, as_leaf
from .weights import Held, stage_tensors

__all__ = ["LocalPipeline", "concat_outputs"]

#: the training and the forward-only execution order of one microbatch count
_Orders = tuple[list[tuple[int, Action]], list[tuple[int, Action]]]


@dataclass
class _Lane:
    """Tensor-parallel index `index`'s copy of every stage (tied copies shared within it)."""

    index: int
    runners: list[StageRunner]
    tied: _Tied


class LocalPipeline(Pipeline[_Orders]):
    """Run a compiled package DIR in this process.

    `schedule` overrides the manifest's (a name or a compute-only per-rank schedule);
    `device` places the stages (one device, one per stage, or one per rank; default CPU).
    `lanes[t]` holds tensor-parallel index t's stages; `runners` are lane 0's.
    """

    def __init__(self, directory: str | Path, *, device: DeviceLike | Sequence[DeviceLike] | None = None,
                 schedule: str | Schedule | None = None) -> None:
        super().__init__(directory)
        m = self.manifest
        self.graph = StageGraph.from_manifest(m)
        pp, self.tp = m.mesh.pp, m.mesh.tp
        self.devices = resolve_devices(device, [self.graph.rank_of(s) for s in range(len(m.stages))], pp)
        if self.tp > 1 and any(d.type != "cpu" for d in self.devices):
            need = pp * self.tp * m.mesh.dp
            raise PipelineError(f"{directory} was compiled with tp={self.tp}, which LocalPipeline runs as {self.tp} "
                                f"threads on the CPU only (autograd runs a CUDA backward on one thread per device, "
                                f"where they would wait on each other): leave device= unset, or run it on GPUs with "
                                f"DistributedPipeline under torchrun (`python -m partitioner run {directory} --nproc "
                                f"{need}`).")
        self.streams = StageStreams(self.devices)
        self.lanes = [self._make_lane(t) for t in range(self.tp)]
        self.runners = self.lanes[0].runners
        # float32 masters of bf16 parameters ([Note: bf16 with master weights] in precision.py)
        self._masters = precision.masters_for([p for _, p in self._module_named()], m.precision)
        self._group = tp.Lanes(self.tp, timeout_from_env()) if self.tp > 1 else None
        self._counts = Counts(lambda count: self._make_orders(schedule, count), m.microbatches,
                              fixed=isinstance(schedule, list))
        self._calls = 0  # train_step, evaluate and __call__ calls: [Note: dropout streams] in modes.py
        self._replica = 0  # the replica being run (its microbatches draw their own streams)

    def _make_orders(self, schedule: str | Schedule | None, count: int) -> _Orders:
        """The training and the forward-only execution order for `count` microbatches
        ([Note: short batch] in counts.py)."""
        m = self.manifest
        compute = schedule if isinstance(schedule, list) else make_schedule(
            schedule or m.schedule, m.mesh.pp, count, m.virtual_stages)
        forward_only = [[a for a in row if a.kind == Kind.F] for row in compute]
        return (execution_order(validate(lower(compute, self.graph), self.graph, count)),
                execution_order(validate(lower(forward_only, self.graph), self.graph, count)))

    def _make_lane(self, index: int) -> _Lane:
        m = self.manifest
        modules = [package.import_stage(self.directory, m, k).to(self.devices[k]) for k in range(len(m.stages))]
        tied = _share_tied(modules, m, self.devices)
        return _Lane(index, [StageRunner(mod, m.stages[k], m.precision) for k, mod in enumerate(modules)], tied)

    # -- the hooks of Pipeline (pipeline.py) -----------------------------------------------------

    def _runners(self) -> list[StageRunner]:
        return [r for lane in self.lanes for r in lane.runners]

    def _module_named(self) -> list[tuple[str, torch.nn.Parameter]]:
        """Lane by lane, each lane's parameters once (a name once per lane)."""
        return [pair for lane in self.lanes for pair in named_once(lane.runners)]

    def _lane_named(self, lane: _Lane) -> list[tuple[str, torch.nn.Parameter]]:
        """`lane`'s parameters as the user sees them: the masters under bf16."""
        return precision.shown(self._masters, named_once(lane.runners))

    def _held(self) -> list[tuple[Held, torch.Tensor]]:
        """Each lane's stages' parameters and persistent buffers (its shards), masters under bf16."""
        return [p for lane in self.lanes for r in lane.runners
                for p in precision.shown(self._masters, stage_tensors(r.module, r.entry, lane.index))]

    def _checkpoint_view(self) -> checkpoint.View:
        return checkpoint.View(self.manifest, self._held(), rank=0, world=1, distributed=False,
                               directory=self.directory)

    def _replicas(self) -> range:
        """Every replica, one after the other."""
        return range(self.manifest.mesh.dp)

    @contextlib.contextmanager
    def _stepping(self) -> Iterator[None]:
        self._calls += 1
        with self._memory.window():
            yield

    def _norm_term(self, p: float) -> torch.Tensor:
        """Every lane's term, summed (or the largest, for the inf-norm)."""
        params = self.parameters()
        device = next((q.grad.device for q in params if q.grad is not None), self.devices[0])
        stages = range(len(self.manifest.stages))
        terms = torch.stack([clip.norm_term(self._lane_named(lane), clip.counted_names(self.manifest, stages, lane.index, 0),
                                            p, device) for lane in self.lanes])
        return terms.amax(0) if p == float("inf") else terms.sum(0)

    def _run_train(self, batch: Batch) -> torch.Tensor:
        """Every replica's schedule in turn; then the tied copies' grads summed, the masters'
        grads taken from the bf16 weights."""
        snapshots = [lane.tied.snapshot() for lane in self.lanes]
        total: torch.Tensor | None = None
        try:
            for replica in self._replicas():
                self._replica = replica
                loss = self._run_lanes(self._counts.get(batch.count)[0], batch.inputs[replica], batch.targets[replica],
                                       batch.loss_fn, batch.scales)
                total = loss if total is None else total + loss
        except BaseException:
            for r in self._runners():
                r.clear()
            raise
        self.streams.synchronize()
        for lane, snapshot in zip(self.lanes, snapshots):
            lane.tied.reduce(snapshot)
        if self._masters is not None:
            self._masters.take_grads()
        assert total is not None
        return total

    def _run_evaluate(self, batch: Batch) -> torch.Tensor:
        total = torch.zeros((), device=self.devices[-1])
        last, fn = self.runners[-1], batch.loss_fn
        assert fn is not None
        for replica in self._replicas():
            self._replica = replica
            outs = self._run_lanes(self._counts.get(batch.count)[1], batch.inputs[replica], None, None, batch.scales)
            for i, out in enumerate(outs):
                t = pytree.tree_map(lambda x: self.streams.move(x, None, len(self.runners) - 1), batch.targets[replica][i])
                total = total + last.loss(i, out, t, fn, batch.scales[i], keep=False)
        self.streams.synchronize()
        return total

    def _run_forward(self, batch: Batch) -> list[Any]:
        outs: list[Any] = []
        for replica in self._replicas():
            self._replica = replica
            outs += self._run_lanes(self._counts.get(batch.count)[1], batch.inputs[replica], None, None, [])
        self.streams.synchronize()
        return outs

    # -- the interpreter ---------------------------------------------------------------------

    def _run_lanes(self, order: list[tuple[int, Action]], mb_inputs: list[dict[str, Any]],
                   targets: list[Any] | None, loss_fn: LossFn | None, scale: list[float]) -> Any:
        """`_run` in every lane at once (step 2), each lane in its own thread, lane 0 in
        this one; returns lane 0's result, or raises the first lane's failure."""
        group = self._group
        if group is None:
            return self._run(self.lanes[0], order, mb_inputs, targets, loss_fn, scale)
        group.reset()
        results: list[Any] = [None] * len(self.lanes)
        failed: list[BaseException] = []
        lock = threading.Lock()
        grad_enabled = torch.is_grad_enabled()  # grad mode is per thread

        def work(lane: _Lane) -> None:
            try:
                with tp.lane(group, lane.index), torch.set_grad_enabled(grad_enabled):
                    results[lane.index] = self._run(lane, order, mb_inputs, targets, loss_fn, scale)
            except BaseException as exc:
                with lock:
                    failed.append(exc)  # before the abort: the others' PeerErrors come after
                group.abort(lane.index)

        threads = [threading.Thread(target=work, args=(lane,), name=f"tp-lane-{lane.index}", daemon=True)
                   for lane in self.lanes[1:]]
        for thread in threads:
            thread.start()
        try:
            work(self.lanes[0])
        finally:
            for thread in threads:
                thread.join()
        if failed:
            raise failed[0]
        return results[0]

    def _run(self, lane: _Lane, order: list[tuple[int, Action]], mb_inputs: list[dict[str, Any]],
             targets: list[Any] | None, loss_fn: LossFn | None, scale: list[float]) -> Any:
        """Interpret one replica's actions in one lane; returns the summed loss (training) or
        the list of microbatch outputs (forward only)."""
        outputs: dict[tuple[int, int], dict[str, Any]] = {}
        in_grads: dict[tuple[int, int], dict[str, torch.Tensor | None]] = {}
        unread: dict[tuple[int, int, str], set[int]] = {}
        results: list[Any] = []
        self.streams.begin()
        with self.streams.on(len(lane.runners) - 1):
            total = torch.zeros((), device=self.devices[-1])
        train = targets is not None
        back = offload.prefetches_in_order(order, offload.ahead())
        for t, (_, a) in enumerate(order):
            offload.bring_back(back.get(t, ()), lane.runners)
            s, i, runner = a.stage, a.microbatch, lane.runners[a.stage]
            if a.kind == Kind.F:
                args = [self._arg(spec, s, i, mb_inputs, outputs) for spec in runner.entry.inputs]
                seed = modes.microbatch_seed(self.manifest.source.seed, self._calls, s, self._replica * len(mb_inputs) + i)
                _forget_read(self.manifest, runner, i, outputs, unread)
                with self.streams.on(s):
                    out = runner.forward(i, args, train, seed)
                    if not runner.is_last:
                        outputs[(s, i)] = dict(zip(runner.output_names, out))
                    elif train:
                        assert loss_fn is not None and targets is not None
                        target = pytree.tree_map(lambda x: self.streams.move(x, None, s), targets[i])
                        total = total + runner.loss(i, out, target, loss_fn, scale[i])
                    else:
                        results.append(out)
            elif a.kind == Kind.W:  # [Note: split backward] in stage.py
                with self.streams.on(s):
                    runner.backward_weight(i)
            elif a.kind.sends_grads:  # B, or I
                grads = None if runner.is_last else [self._grad(o, s, i, in_grads) for o in runner.entry.outputs]
                with self.streams.on(s):
                    got = runner.backward(i, grads) if a.kind == Kind.B else runner.backward_input(i, grads)
                in_grads[(s, i)] = {spec.name: g for spec, g in zip(runner.entry.inputs, got) if not spec.from_batch}
        return total if train else results

    def _arg(self, spec: StageInput, stage: int, mb: int, mb_inputs: list[dict[str, Any]],
             outputs: dict[tuple[int, int], dict[str, Any]]) -> Any:
        if spec.source == "input":
            return self.streams.move(mb_inputs[mb][spec.name], None, stage)
        value = outputs[(spec.source, mb)][spec.name]
        moved = self.streams.move(value, spec.source, stage)
        return as_leaf(moved, isinstance(value, torch.Tensor) and value.requires_grad)

    def _grad(self, out: StageOutput, stage: int, mb: int,
              in_grads: dict[tuple[int, int], dict[str, torch.Tensor | None]]) -> torch.Tensor | None:
        """The gradient of one output: the sum over every later stage that read it."""
        total: torch.Tensor | None = None
        for c in out.to if out.to != "output" else ():
            g = in_grads.get((c, mb), {}).pop(out.name, None)
            if g is not None:
                g = self.streams.move(g, c, stage)
                total = g if total is None else total + g
        return total


def _forget_read(manifest: Manifest, reader: StageRunner, mb: int,
                 outputs: dict[tuple[int, int], dict[str, Any]], unread: dict[tuple[int, int, str], set[int]]) -> None:
    """Drop microbatch `mb`'s values that `reader`'s forward was the last to read
    (`unread`: the stages yet to read each value).

    A value is kept until every stage that reads it has run its forward, not until its
    producer's backward: a producer whose outputs need no gradient (CLIP's text model: stage
    0 builds only a constant mask) may run its backward before a reader's forward (1F1B
    ran `0B3` before `1F3`)."""
    for spec in reader.entry.inputs:
        if spec.source == "input":
            continue
        key = (spec.source, mb, spec.name)
        if key not in unread:
            out = next(o for o in manifest.stages[spec.source].outputs if o.name == spec.name)
            unread[key] = set(out.to) if out.to != "output" else set()
        unread[key].discard(reader.index)
        if not unread[key]:
            del unread[key]
            outputs[(spec.source, mb)].pop(spec.name, None)


class _Tied:
    """Tied parameters whose copies sit on different devices: their grads are summed after
    each step (new total = old grad + the sum of every copy's contribution)."""

    def __init__(self, groups: list[list[torch.nn.Parameter]]) -> None:
        self.groups = groups

    def snapshot(self) -> list[list[torch.Tensor | None]]:
        return [[None if p.grad is None else p.grad.detach().clone() for p in g] for g in self.groups]

    def reduce(self, snapshot: list[list[torch.Tensor | None]]) -> None:
        for group, old in zip(self.groups, snapshot):
            base = old[0]
            total = None if base is None else base.clone()
            for p, o in zip(group, old):
                if p.grad is not None:
                    delta = (p.grad - o if o is not None else p.grad).to(group[0].device)
                    total = delta if total is None else total + delta
            if total is not None:
                for p in group:
                    p.grad = total.to(p.device).clone()


def _share_tied(modules: list[torch.nn.Module], manifest: Manifest, devices: list[torch.device]) -> _Tied:
    """Make the copies of each tied parameter one shared nn.Parameter where they share a
    device (gradients then sum by themselves); return the groups that cannot share."""
    holders: dict[str, list[tuple[int, str]]] = {}
    for k, stage in enumerate(manifest.stages):
        for spec in stage.parameters:
            holders.setdefault(spec.source_name, []).append((k, spec.name))
    apart: list[list[torch.nn.Parameter]] = []
    for copies in holders.values():
        if len(copies) < 2:
            continue
        by_device: dict[torch.device, torch.nn.Parameter] = {}
        for k, name in copies:
            param = getattr(modules[k], name)
            shared = by_device.setdefault(devices[k], param)
            if shared is not param:
                setattr(modules[k], name, shared)
        if len(by_device) > 1:
            apart.append(list(by_device.values()))
    return _Tied(apart)
