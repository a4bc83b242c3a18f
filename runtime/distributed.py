"""`DistributedPipeline`: one process per rank under torchrun (the user-facing contract: README.md, "Use").

Global rank = (replica * pp + position) * tp + t (groups.Mesh); stage s sits at position
s % pp, or in a V under zb-v ([Note: V placement] in schedule/registry.py), so with the interleaved
and zb-v schedules a rank holds several (virtual) stages, and the
tp ranks t = 0..tp-1 of a position are neighbours that each hold their own shards of the
same stages (the same stage files; [Note: shards] in package.py).  Each rank imports only
its own stage files and interprets its own row of the lowered schedule:

    train_step on one rank:
      1. take replica r's rows of the global batch, split into M microbatches
      2. for each action of this rank's row (schedule.lower + validate):
           F / B            as in LocalPipeline (stage.py); the last stage adds the loss.
                            The stage code's tp.* collectives (tp.py) run inside, over
                            this position's tensor-parallel group: every tp rank runs the
                            same row, so they meet in the same order
           SEND_F / SEND_B  isend the edge's values (shape, dtype from the manifest; tp
                            rank t sends its own local tensors to tp rank t) as one
                            message (messages.py), wait at 7; on CUDA from the
                            communication stream ([Note: communication stream] in
                            devices.py)
           RECV_F / RECV_B  irecv into a fresh buffer and wait, with the timeout; on
                            gloo the irecv is posted before the previous compute
                            ([Note: receives posted ahead] in schedule/lowering.py); on
                            CUDA on the communication stream, which compute then waits for
           I / W            B split in two ([Note: split backward] in stage.py)
           before the last B (or W) of each stage: arm its dp gradient buckets (comm.py)
      3. wait for the dp buckets: gradients averaged over the replicas
      4. tied parameters across ranks: sum the copies' contributions (comm.TiedGrads)
      5. the loss: all_reduce of the last stages' sums over the world (t = 0 only: every
         tp rank computes the same loss), / dp
      6. the trace, when asked for, is gathered on rank 0
      7. (sends are waited on before 3)

Faults: every wait has a timeout (PIPELINE_TIMEOUT_S, default 60 s) and a failed or
silent peer becomes a `PeerError` naming this rank, its stage, the action, the
microbatch and the peer.  Test hook: PIPELINE_FAULT="RANK:ACTION[:exit|raise|hang]"
(e.g. "1:1B0") makes rank RANK exit, raise or hang right before ACTION.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from . import checkpoint, clip, initialize, messages, modes, optim, package, precision, tp
from .comm import GradBuckets, TiedGrads, guard, init_from_env, timeout_from_env, wait
from .counts import Counts
from .devices import CommStream
from .errors import ManifestError, MeshError, PipelineError
from .faults import parse_fault
from .groups import Mesh, make_groups
from .local import concat_outputs
from .manifest import Manifest
from .schedule import Action, Kind, Schedule, StageGraph, lower, make_schedule, receives_ahead, validate
from .stage import StageRunner, as_leaf
from .steps import StepGuard
from .tracing import Tracer

__all__ = ["DistributedPipeline"]

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass
class _Step:
    """What one step keeps between actions on this rank."""

    train: bool
    evaluate: bool = False  # forward only, the loss kept instead of the outputs
    outputs: dict[tuple[int, int], dict[str, torch.Tensor]] = field(default_factory=dict)
    received: dict[tuple[int, int], dict[str, torch.Tensor]] = field(default_factory=dict)
    in_grads: dict[tuple[int, int], dict[str, torch.Tensor | None]] = field(default_factory=dict)
    out_grads: dict[tuple[int, int], dict[str, torch.Tensor]] = field(default_factory=dict)
    sends: list[tuple[Any, Action, torch.Tensor]] = field(default_factory=list)
    posted: dict[Action, _Receive | None] = field(default_factory=dict)  # receives posted ahead
    loss: torch.Tensor | None = None
    results: list[Any] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # each microbatch's rows ([Note: free batch])
    scales: list[float] = field(default_factory=list)  # [Note: microbatch weights]


@dataclass(frozen=True)
class _Receive:
    """A posted receive: its work, its buffer, and what the buffer holds."""

    work: Any
    buffer: torch.Tensor
    specs: list[Any]
    shapes: list[list[int]]
    dtypes: list[torch.dtype]


@dataclass
class _Now:
    """The action this rank is running, or ran last (None before the first)."""

    action: Action | None = None


class DistributedPipeline:
    """Run this rank's stages of package DIR; every rank calls every method (collectively)."""

    def __init__(self, directory: str | Path, *, schedule: str | Schedule | None = None,
                 timeout_s: float | None = None, trace: str | Path | None = None) -> None:
        # 1. the manifest and the process group
        self.directory = Path(directory)
        self.manifest = m = package.load_manifest(directory)
        self.timeout_s = timeout_from_env(timeout_s)
        self.mesh = Mesh.from_manifest(m)
        self.pp, self.tp, self.dp = self.mesh.pp, self.mesh.tp, self.mesh.dp
        given = os.environ.get("WORLD_SIZE", "")
        if not dist.is_initialized() and given.isdigit():
            self._check_world(int(given))  # before joining: a clear error, not a hang
        self.device = init_from_env(self.timeout_s)
        self._comm = CommStream(self.device)  # what the pipeline's messages are posted from
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._check_world(self.world)
        self._check_same_package()
        # 2. where this rank sits; every process group ([Note: process groups] in comm.py)
        self.graph = g = StageGraph.from_manifest(m)
        self.replica, self.position, self.tp_index = self.mesh.coords(self.rank)
        _check_ranks(m, self.mesh, g)
        self.stages = [s for s in range(g.num_stages) if g.rank_of(s) == self.position]
        self._describe = _describer(self.rank, self.stages)  # (holds no self: see _describer)
        self._now = _Now()  # the action running now, for tp's error messages
        self.groups = make_groups(m, g, self.rank)
        self._set_tp_group()
        # 3. this rank's stages (tied copies within the rank are one shared Parameter)
        self.runners = {s: StageRunner(package.import_stage(directory, m, s).to(self.device), m.stages[s], m.precision)
                        for s in self.stages}
        self._share_tied()
        # float32 masters of bf16 parameters ([Note: bf16 with master weights] in precision.py)
        self._masters = precision.masters_for([p for _, p in self._module_named()], m.precision)
        # 4. gradient buckets, tied gradients
        plain = self._setup_grads()
        # 5. the schedule: every rank lowers and validates the whole one, then keeps its row;
        # a short batch's smaller count is made when one comes ([Note: short batch] in counts.py)
        self._rows = Counts(_rows_builder(schedule, m, g, self.position, self._comm.stream is None, self.runners,
                                          plain), m.microbatches, fixed=isinstance(schedule, list))
        self.tracer = Tracer(trace or os.environ.get("PIPELINE_TRACE") or None, self.rank, self.stages)
        self._fault = parse_fault(os.environ.get("PIPELINE_FAULT", ""))
        self._loss_fn: LossFn | None = None
        self.training = True
        # the calls of train_step, evaluate and __call__, checked across ranks ([Note: step numbers] in steps.py)
        self._steps = StepGuard(self.groups.world, self.rank, self.world, self.device, self.timeout_s,
                                self._describe("the step check", range(self.world)))

    # -- the contract ------------------------------------------------------------------------

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        """Take this rank's tensors from the ORIGINAL model's state_dict (not collective)."""
        if strict:
            package.check_state_dict(state_dict, self.manifest)
        for r in self.runners.values():
            package.load_stage_state(self._tensors(r), state_dict, self.manifest)

    def state_dict(self, rank: int | None = None) -> dict[str, torch.Tensor]:
        """The full original state_dict on every rank, on CPU (collective); with `rank`, on that
        rank only (the others get {} and never hold the whole model)."""
        mine = [(spec, t.detach().cpu()) for r in self.runners.values() for spec, t in self._tensors(r)]
        gathered: list[Any] = [None] * self.world
        if rank is None:
            dist.all_gather_object(gathered, mine if self.replica == 0 else [], group=self.groups.world)
        else:
            dist.gather_object(mine if self.replica == 0 else [], gathered if self.rank == rank else None, dst=rank,
                               group=self.groups.world)
            if self.rank != rank:
                return {}
        return package.assemble_state_dict([p for pieces in gathered for p in pieces], self.manifest)

    def parameters(self) -> list[torch.nn.Parameter]:
        """This rank's parameters, each once, for its optimizer."""
        return [p for _, p in self.named_parameters()]

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(original name, parameter) for this rank's parameters, each once (the masters under bf16)."""
        return precision.shown(self._masters, self._module_named())

    def _module_named(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(original name, stage module parameter) for this rank's parameters, each once."""
        seen: dict[int, tuple[str, torch.nn.Parameter]] = {}
        for s in self.stages:
            r = self.runners[s]
            for spec in r.entry.parameters:
                p = getattr(r.module, spec.name)
                seen.setdefault(id(p), (spec.source_name, p))
        return list(seen.values())

    def train(self, mode: bool = True) -> DistributedPipeline:
        """This rank's stage modules in training mode, or eval mode: as nn.Module.train
        (every rank calls it, as every rank runs the steps)."""
        self.training = bool(mode)
        for r in self.runners.values():
            r.module.train(mode)
        return self

    def eval(self) -> DistributedPipeline:
        """`train(False)`."""
        return self.train(False)

    def evaluate(self, inputs: Any, target: Any, loss_fn: LossFn | None = None) -> torch.Tensor:
        """The whole-batch loss on every rank (collective): forward only, no autograd graph,
        no outputs gathered (the last stage's ranks compute their microbatches' losses)."""
        with self._steps.step():
            return self._evaluate(inputs, target, loss_fn)

    def recover(self) -> None:
        """After a failed step (StepError on every rank): agree on the step count and accept
        steps again (collective: every rank calls it).  Gradients are left as they are:
        zero them before the next step."""
        for r in self.runners.values():
            r.clear()
        if self._buckets is not None:
            self._buckets.reset()
        self._steps.recover()

    def _evaluate(self, inputs: Any, target: Any, loss_fn: LossFn | None) -> torch.Tensor:
        fn, mb_inputs, targets, rows = self._share(inputs, target, loss_fn)
        order = self._rows.get(len(rows))
        self._begin()
        step = _Step(train=False, evaluate=True, rows=rows, scales=package.loss_scales(rows))
        with torch.no_grad():
            self._run(order.forward, order.forward_ahead, step, mb_inputs, targets, fn)
            self._wait_sends(step)
            loss = self._reduce_loss(step)
        self.tracer.flush()
        return loss

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ of the original model (collective): the whole
        model's gradient norm on every rank, each parameter counted once ([Note: counting
        each parameter once] in clip.py), and this rank's gradients scaled by it."""
        p = clip.check_norm_type(norm_type)
        named = self.named_parameters()
        counted = clip.counted_names(self.manifest, self.stages, self.tp_index, self.replica)
        term = clip.norm_term(named, counted, p, self.device)
        doing = self._describe("the gradient norm all_reduce", range(self.world))
        with self.tracer.collective("gradient norm all_reduce"):
            with guard(doing):
                work = dist.all_reduce(term, op=dist.ReduceOp.MAX if p == float("inf") else dist.ReduceOp.SUM,
                                       group=self.groups.world, async_op=True)
            wait(work, self.timeout_s, doing)
        params = [q for _, q in named]
        total = clip.total_norm(term, p, clip.grad_dtype(params))
        clip.clip_(params, total, max_norm, p, error_if_nonfinite)
        return total

    def make_optimizer(self, cls: type[torch.optim.Optimizer], params: optim.ParamGroups = None,
                       **defaults: Any) -> torch.optim.Optimizer:
        """`cls` over this rank's parameters, groups by original name, the same groups on
        every rank ([Note: parameter groups by original name] in optim.py); with `--zero 1`,
        its state sharded across this rank's data-parallel replicas ([Note: ZeRO-1] there)."""
        shard = self.groups.dp if self.dp > 1 and optim.zero_stage(self.manifest) == 1 else None
        opt = optim.make_optimizer(cls, self.named_parameters(), self.manifest, params, shard, **defaults)
        self.tracer.watch(opt)
        return opt

    def train_step(self, inputs: Any, target: Any, loss_fn: LossFn | None = None) -> torch.Tensor:
        """One step on the global batch (collective); returns the whole-batch loss on every rank.
        After a failed step every rank refuses the next ones until `recover()` ([Note: step
        numbers] in steps.py)."""
        with self._steps.step():
            return self._train_step(inputs, target, loss_fn)

    def _share(self, inputs: Any, target: Any, loss_fn: LossFn | None
               ) -> tuple[LossFn | None, list[dict[str, Any]], list[Any], list[int]]:
        """This rank's share of a global batch: the loss function (only the last stage needs
        one), its replica's microbatch inputs and targets, and each microbatch's rows."""
        self._set_tp_group()  # tp.* is process-wide: several pipelines in one process take turns
        m = self.manifest
        holds_last = self.graph.num_stages - 1 in self.runners
        fn = loss_fn or (self._default_loss_fn() if holds_last else None)
        count = self._rows.fit(package.replica_rows(inputs, m))
        mb_inputs = package.split_inputs(inputs, m, self.replica, count)
        rows = package.microbatch_rows(inputs, m, count)
        targets = package.split_target(target, count, self.replica, self.dp, sum(rows) * self.dp)
        return fn, mb_inputs, targets, rows

    def _train_step(self, inputs: Any, target: Any, loss_fn: LossFn | None) -> torch.Tensor:
        fn, mb_inputs, targets, rows = self._share(inputs, target, loss_fn)
        order = self._rows.get(len(rows))
        snapshot = self._ties.snapshot()
        if self._buckets is not None:
            self._buckets.reset()
        self._begin()
        step = _Step(train=True, rows=rows, scales=package.loss_scales(rows))
        try:
            self._run(order.train, order.train_ahead, step, mb_inputs, targets, fn, order.arm_at)
            self._wait_sends(step)
            if self._buckets is not None:
                with self.tracer.collective("data-parallel gradient all_reduce (what backward left)"):
                    self._buckets.finish()
            with self.tracer.collective("tied gradient all_reduce"):
                self._ties.reduce(snapshot)
            if self._masters is not None:
                self._masters.take_grads()
            loss = self._reduce_loss(step)
        finally:
            for r in self.runners.values():
                r.clear()
        self.tracer.flush()
        return loss

    def _reduce_loss(self, step: _Step) -> torch.Tensor:
        """The whole-batch loss on every rank: the last stages' sums over the world, / dp."""
        # every tp rank of the last stage has the same loss: t == 0 counts it
        loss = step.loss if step.loss is not None and self.tp_index == 0 else torch.zeros((), device=self.device)
        doing = self._describe("the loss all_reduce", range(self.world))
        with self.tracer.collective("loss all_reduce"):
            with guard(doing):
                work = dist.all_reduce(loss, group=self.groups.world, async_op=True)
            wait(work, self.timeout_s, doing)
        return loss / self.dp

    def __call__(self, inputs: Any) -> Any:
        """Forward only: the whole global batch's output on every rank, on CPU (collective)."""
        with self._steps.step():
            return self._call(inputs)

    def _call(self, inputs: Any) -> Any:
        self._set_tp_group()
        count = self._rows.fit(package.replica_rows(inputs, self.manifest))
        mb_inputs = package.split_inputs(inputs, self.manifest, self.replica, count)
        order = self._rows.get(count)
        self._begin()
        step = _Step(train=False, rows=package.microbatch_rows(inputs, self.manifest, count))
        with torch.no_grad():
            self._run(order.forward, order.forward_ahead, step, mb_inputs, None, None)
            self._wait_sends(step)
        last = self.graph.rank_of(self.graph.num_stages - 1)
        mine = [_to_cpu(o) for o in step.results] if self.position == last and self.tp_index == 0 else None
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, mine, group=self.groups.world)
        return concat_outputs([o for r in range(self.dp) for o in gathered[self.mesh.rank(r, last, 0)]],
                              self.manifest.output_batch_dims)

    # -- checkpoints (runtime/checkpoint/; docs/checkpoints.md) ------------------------------

    def save_checkpoint(self, path: str | Path, optimizer: torch.optim.Optimizer | None = None, extra: Any = None,
                        keep: int | None = None) -> Path:
        """Write checkpoint PATH from every rank in parallel (collective; atomic: complete or
        invisible); with `keep`, then remove all but the newest `keep` beside it."""
        return checkpoint.save(self._checkpoint_view(), path, optimizer, extra, keep)

    def load_checkpoint(self, path: str | Path, optimizer: torch.optim.Optimizer | None = None,
                        strict: bool = True) -> Any:
        """Restore a checkpoint of `save_checkpoint` from any plan of the model (collective; each
        rank reads only its own tensors and slices); returns its `extra`."""
        return checkpoint.load(self._checkpoint_view(), path, optimizer, strict)

    def init_weights(self, seed: int = 0) -> None:
        """Initialise this process's parameters (its shards only) with the values they have on
        every plan: runtime.init_weights(model, seed) on the unsplit model gives the same."""
        initialize.init_pipeline(self._checkpoint_view().held, self.manifest, self.directory, seed)

    def _checkpoint_view(self) -> checkpoint.View:
        held = [p for r in self.runners.values() for p in self._tensors(r)]
        return checkpoint.View(self.manifest, held, rank=self.rank, world=self.world, distributed=True,
                               directory=self.directory, group=self.groups.world)

    # -- the interpreter ---------------------------------------------------------------------

    def _run(self, actions: list[Action], ahead: dict[int, tuple[int, ...]], step: _Step,
             mb_inputs: list[dict[str, Any]], targets: list[Any] | None, loss_fn: LossFn | None,
             arm_at: dict[int, list[torch.nn.Parameter]] | None = None) -> None:
        """Run this rank's row of actions; before each compute, post the receives of the
        next (`ahead`: [Note: receives posted ahead] in schedule/lowering.py); before the last B (or
        W) of each stage, arm its gradient buckets (`arm_at`)."""
        for t, a in enumerate(actions):
            if arm_at and t in arm_at and self._buckets is not None:
                self._buckets.arm(arm_at[t])
            for j in ahead.get(t, ()):
                step.posted[actions[j]] = self._post_recv(actions[j], step)
            self._execute(a, step, mb_inputs, targets, loss_fn)

    def _execute(self, a: Action, step: _Step, mb_inputs: list[dict[str, Any]], targets: list[Any] | None,
                 loss_fn: LossFn | None) -> None:
        if self._fault is not None:
            self._fault.check(self.rank, a)
        s, i = a.stage, a.microbatch
        self._now.action = a
        with self.tracer.span(repr(a), s, a.kind.value, i, **({"peer": a.peer} if a.peer is not None else {})):
            if a.kind == Kind.F:
                self._forward(s, i, step, mb_inputs, targets, loss_fn)
            elif a.kind == Kind.W:
                self.runners[s].backward_weight(i)  # [Note: split backward] in stage.py
            elif a.kind.sends_grads:
                self._backward(s, i, step, a.kind == Kind.I)
            elif a.kind.is_send:
                self._send(a, step)
            else:
                self._recv(a, step)

    def _forward(self, s: int, i: int, step: _Step, mb_inputs: list[dict[str, Any]], targets: list[Any] | None,
                 loss_fn: LossFn | None) -> None:
        runner, args = self.runners[s], []
        for spec in runner.entry.inputs:
            src = spec.source
            if src == "input":
                value = mb_inputs[i][spec.name]
                args.append(value.to(self.device) if isinstance(value, torch.Tensor) else value)
            elif self.graph.rank_of(src) == self.position:  # a stage on this rank: in memory
                value = step.outputs[(src, i)][spec.name]
                args.append(as_leaf(value, value.requires_grad))
            else:
                args.append(step.received[(s, i)].pop(spec.name))
        m = self.manifest
        seed = modes.microbatch_seed(m.source.seed, self._steps.call, s, self.replica * m.microbatches + i)
        out = runner.forward(i, args, step.train, seed)
        if not runner.is_last:
            step.outputs[(s, i)] = dict(zip(runner.output_names, out))
        elif step.train or step.evaluate:
            assert targets is not None and loss_fn is not None
            loss = runner.loss(i, out, _to(targets[i], self.device), loss_fn, step.scales[i], keep=step.train)
            step.loss = loss if step.loss is None else step.loss + loss
        else:
            step.results.append(out)

    def _backward(self, s: int, i: int, step: _Step, input_only: bool = False) -> None:
        runner = self.runners[s]
        grads: list[torch.Tensor | None] | None = None
        if not runner.is_last:
            remote = step.out_grads.pop((s, i), {})
            grads = []
            for out in runner.entry.outputs:
                total = remote.get(out.name)
                for c in out.to if out.to != "output" else ():
                    if self.graph.rank_of(c) == self.position:
                        g = step.in_grads.get((c, i), {}).pop(out.name, None)
                        if g is not None:
                            total = g if total is None else total + g
                grads.append(total)
        got = runner.backward_input(i, grads) if input_only else runner.backward(i, grads)
        step.in_grads[(s, i)] = {spec.name: g for spec, g in zip(runner.entry.inputs, got) if not spec.from_batch}
        step.outputs.pop((s, i), None)

    def _send(self, a: Action, step: _Step) -> None:
        assert a.peer is not None
        forward = a.kind == Kind.SEND_F
        specs = package.edge_values(self.manifest, a.stage, a.peer) if forward else package.edge_grads(self.manifest, a.peer, a.stage)
        group, dst = self.groups.edges[(a.stage, a.peer) if forward else (a.peer, a.stage)], self._rank_of(a.peer)
        tensors = []
        for spec in specs:
            shape = package.value_shape(spec, step.rows[a.microbatch], self.manifest)
            if forward:
                tensor = step.outputs[(a.stage, a.microbatch)][spec.name].detach()
            else:
                g = step.in_grads.get((a.stage, a.microbatch), {}).pop(spec.name, None)
                tensor = g if g is not None else torch.zeros(shape, dtype=package.dtype_of(spec), device=self.device)
            if list(tensor.shape) != shape or tensor.dtype != package.dtype_of(spec):
                raise PipelineError(f"stage {a.stage} sends {spec.name!r} of microbatch {a.microbatch} with shape "
                                    f"{list(tensor.shape)} {tensor.dtype} but the manifest says {shape} "
                                    f"{spec.dtype}: compile the model again (the runtime sends no shapes).")
            tensors.append(tensor.contiguous())
        if not tensors:
            return  # no gradient flows back on this edge
        message = tensors[0] if len(tensors) == 1 else messages.pack(tensors)  # [Note: one message per hand-over]
        with guard(self._doing(a)), self._comm.sending():
            work = dist.isend(message, dst=dst, group=group, tag=self._tag(a.microbatch, forward))
        step.sends.append((work, a, message))  # kept until _wait_sends: [Note: communication stream] rule 2

    def _post_recv(self, a: Action, step: _Step) -> _Receive | None:
        """Post the receive of `a` into a fresh buffer (None: nothing flows on its edge)."""
        assert a.peer is not None
        forward = a.kind == Kind.RECV_F
        specs = package.edge_values(self.manifest, a.peer, a.stage) if forward else package.edge_grads(self.manifest, a.stage, a.peer)
        if not specs:
            return None
        group, src = self.groups.edges[(a.peer, a.stage) if forward else (a.stage, a.peer)], self._rank_of(a.peer)
        rows = step.rows[a.microbatch]
        shapes = [package.value_shape(spec, rows, self.manifest) for spec in specs]
        dtypes = [package.dtype_of(spec) for spec in specs]
        if len(specs) == 1:
            buffer = self._comm.empty(shapes[0], dtypes[0])
        else:  # the edge's values packed in one message (messages.py)
            buffer = self._comm.empty([messages.layout(shapes, dtypes)[1]], torch.uint8)
        with self._comm.posting(), guard(self._doing(a)):
            work = dist.irecv(buffer, src=src, group=group, tag=self._tag(a.microbatch, forward))
        return _Receive(work, buffer, specs, shapes, dtypes)

    def _recv(self, a: Action, step: _Step) -> None:
        """Wait for the receive of `a` (posted now unless it was posted ahead) and file its values."""
        got = step.posted.pop(a) if a in step.posted else self._post_recv(a, step)
        if got is None:
            return
        with self._comm.receiving(got.buffer):
            wait(got.work, self.timeout_s, self._doing(a))
        values = [got.buffer] if len(got.specs) == 1 else messages.unpack(got.buffer, got.shapes, got.dtypes)
        key = (a.stage, a.microbatch)
        for spec, value in zip(got.specs, values):
            if a.kind == Kind.RECV_F:
                step.received.setdefault(key, {})[spec.name] = as_leaf(value, spec.requires_grad)
            else:
                have = step.out_grads.setdefault(key, {})
                have[spec.name] = value if spec.name not in have else have[spec.name] + value

    def _wait_sends(self, step: _Step) -> None:
        for work, a, _ in step.sends:
            wait(work, self.timeout_s, self._doing(a))
        step.sends.clear()

    # -- set-up ------------------------------------------------------------------------------

    def _check_world(self, world: int) -> None:
        need = self.mesh.world
        if world != need:
            raise MeshError(f"{self.directory} is planned for pp={self.pp} x tp={self.tp} x dp={self.dp} = {need} ranks but "
                            f"WORLD_SIZE is {world}: launch {need} processes (--nproc {need}), or compile the model "
                            f"for {world} devices.")

    def _check_same_package(self) -> None:
        mine = (self.manifest.hash, str(self.directory))
        every: list[Any] = [None] * self.world
        try:
            dist.all_gather_object(every, mine)
        except Exception as exc:
            raise MeshError(f"rank {self.rank} failed comparing package hashes at start-up ({exc}): another rank "
                            f"stopped or failed; look at its own error.") from None
        odd = [r for r, (h, _) in enumerate(every) if h != every[0][0]]
        if odd:
            lines = "; ".join(f"rank {r}: {d} (hash {h[:12] or 'none'})" for r, (h, d) in enumerate(every))
            raise MeshError(f"the ranks run different packages ({lines}): give every rank the same package DIR.")

    def _share_tied(self) -> None:
        shared: dict[str, torch.nn.Parameter] = {}
        for s in self.stages:
            r = self.runners[s]
            for spec in r.entry.parameters:
                p = getattr(r.module, spec.name)
                first = shared.setdefault(spec.source_name, p)
                if first is not p:
                    setattr(r.module, spec.name, first)

    def _setup_grads(self) -> list[torch.nn.Parameter]:
        """Data-parallel buckets and tied gradients; the parameters the buckets hold."""
        groups = self.groups
        mine = dict(self._module_named())
        tied = [(mine[n], group, n) for n, (group, _) in groups.ties.items() if n in mine and mine[n].requires_grad]
        describe = self._describe
        self._ties = TiedGrads(tied, self.dp, self.timeout_s, lambda name, t, why: describe(
            f"the gradient sum of tied parameter {name}", groups.ties[name][1])(t, why))
        plain = [p for n, p in mine.items() if p.requires_grad and n not in groups.ties]
        self._buckets = (GradBuckets(plain, groups.dp, self.dp, self.timeout_s,
                                     self._describe("the data-parallel gradient all_reduce", groups.dp_ranks))
                         if self.dp > 1 and plain else None)
        return plain

    # -- helpers -----------------------------------------------------------------------------

    def _set_tp_group(self) -> None:
        """Point tp.* at this (replica, position)'s tensor-parallel group (none when tp == 1).
        Its error wording reads the action running now from `self._now`, not from the
        pipeline, which tp's module state would otherwise keep alive (see _describer)."""
        if self.tp == 1:
            tp.reset()
            return
        now, rank, index, timeout = self._now, self.rank, self.tp_index, self.timeout_s
        others = ", ".join(f"rank {r} (tp index {u})" for u, r in enumerate(self.groups.tp_ranks) if r != rank)

        def doing(collective: str, timed_out: bool, reason: str) -> str:
            a = now.action
            during = f" during {a!r} (stage {a.stage}, microbatch {a.microbatch})" if a is not None else ""
            return (f"rank {rank} (tp index {index}) {'timed out' if timed_out else 'failed'} in {collective}"
                    f"{during}: {others} of its tensor-parallel group stopped or failed ({reason}). Look at that "
                    f"rank's own error; if it is only slow, raise PIPELINE_TIMEOUT_S (now {timeout:g} s).")
        tp.set_group(self.groups.tp, index, self.tp, timeout, doing)

    def _tensors(self, runner: StageRunner) -> list[tuple[package.Held, torch.Tensor]]:
        """A stage's parameters and persistent buffers as the user sees them (masters under bf16)."""
        return precision.shown(self._masters, package.stage_tensors(runner.module, runner.entry, self.tp_index))

    def _begin(self) -> None:
        """Before the stages run: the ranks agree on the step ([Note: step numbers] in steps.py),
        and the bf16 weights are brought up to date with their masters."""
        self._steps.check()
        if self._masters is not None:
            self._masters.refresh()

    def _rank_of(self, stage: int) -> int:
        return self.mesh.rank(self.replica, self.graph.rank_of(stage), self.tp_index)

    def _tag(self, microbatch: int, forward: bool) -> int:
        """The step (mod 2^12), the microbatch and the direction: [Note: step numbers] in steps.py."""
        return ((self._steps.call % 4096) * self.manifest.microbatches + microbatch) * 2 + (0 if forward else 1)

    def _doing(self, a: Action) -> Callable[[bool, str], str]:
        peer = self._rank_of(a.peer) if a.peer is not None else -1
        direction = "from" if a.kind.startswith("RECV") else "to"

        def say(timed_out: bool, reason: str) -> str:
            return (f"rank {self.rank} (stage {a.stage}) {'timed out' if timed_out else 'failed'} in {a.kind} "
                    f"{direction} stage {a.peer}, microbatch {a.microbatch}: rank {peer} stopped or failed "
                    f"({reason}). Look at rank {peer}'s own error; if it is only slow, raise PIPELINE_TIMEOUT_S "
                    f"(now {self.timeout_s:g} s).")
        return say

    def _default_loss_fn(self) -> LossFn:
        if self._loss_fn is None:
            self._loss_fn = package.load_loss_fn(self.manifest, self.directory)
        return self._loss_fn


def _describer(rank: int, stages: list[int]) -> Callable[[str, Any], Callable[[bool, str], str]]:
    """`describe(what, ranks)`: the words for a failed collective `what` among `ranks`.

    It closes over this rank's numbers, not over the pipeline: error callbacks the pipeline
    keeps (tied gradients, buckets) would otherwise hold it in a reference cycle, and a
    pipeline in a cycle is freed, process groups and all, only by the garbage collection at
    interpreter exit, when a gloo thread still freeing a finished barrier cannot take the
    GIL any more: std::terminate (pytorch/pytorch#179291)."""
    where = ", ".join(map(str, stages))

    def describe(what: str, ranks: Any) -> Callable[[bool, str], str]:
        others = [r for r in ranks if r != rank]

        def say(timed_out: bool, reason: str) -> str:
            who = f"one of ranks {others}" if others else "another rank"
            return (f"rank {rank} (stage {where}) {'timed out' if timed_out else 'failed'} in {what}: {who} "
                    f"stopped or failed ({reason}). Look at that rank's own error.")
        return say
    return describe


@dataclass(frozen=True)
class _Rows:
    """This rank's actions for one microbatch count, and what goes with them."""

    train: list[Action]
    forward: list[Action]
    train_ahead: dict[int, tuple[int, ...]]
    forward_ahead: dict[int, tuple[int, ...]]
    arm_at: dict[int, list[torch.nn.Parameter]]


def _rows_builder(schedule: str | Schedule | None, m: Manifest, g: StageGraph, position: int, early: bool,
                  runners: Mapping[int, StageRunner], plain: list[torch.nn.Parameter]) -> Callable[[int], _Rows]:
    """count -> this rank's `_Rows` (closing over no pipeline: [Note: short batch] in counts.py)."""

    def build(count: int) -> _Rows:
        compute = schedule if isinstance(schedule, list) else make_schedule(
            schedule or m.schedule, m.mesh.pp, count, m.virtual_stages)
        fwd = [[a for a in row if a.kind == Kind.F] for row in compute]
        train, forward = _row(lower(compute, g), g, count, position), _row(lower(fwd, g), g, count, position)
        # gloo takes receives early; NCCL matches point-to-point messages in the order they
        # are posted on one stream, so there each is posted where it is waited for
        # ([Note: receives posted ahead] in schedule/lowering.py)
        ahead = (receives_ahead(train), receives_ahead(forward)) if early else ({}, {})
        return _Rows(train, forward, *ahead, _arm_points(train, runners, plain))

    return build


def _arm_points(actions: list[Action], runners: Mapping[int, StageRunner],
                plain: list[torch.nn.Parameter]) -> dict[int, list[torch.nn.Parameter]]:
    """Arm each parameter right before the last B or W (of any stage holding it) on this rank."""
    last_b: dict[int, int] = {}
    for t, a in enumerate(actions):
        if a.kind in (Kind.B, Kind.W):
            for spec in runners[a.stage].entry.parameters:
                last_b[id(getattr(runners[a.stage].module, spec.name))] = t
    arm_at: dict[int, list[torch.nn.Parameter]] = {}
    for p in plain:
        if id(p) in last_b:
            arm_at.setdefault(last_b[id(p)], []).append(p)
    return arm_at


def _row(lowered: Schedule, g: StageGraph, microbatches: int, position: int) -> list[Action]:
    validate(lowered, g, microbatches)
    return lowered[position]


def _check_ranks(m: Manifest, mesh: Mesh, g: StageGraph) -> None:
    for stage in m.stages:
        want = [mesh.rank(r, g.rank_of(stage.index), t) for r in range(mesh.dp) for t in range(mesh.tp)]
        if list(stage.ranks) != want:
            raise ManifestError(f"stage {stage.index} lists ranks {list(stage.ranks)} but this runtime places it on "
                                f"{want} ((replica * pp + position) * tp + t, the position of {m.schedule}'s "
                                f"placement): compile the model again.")


def _to(value: Any, device: torch.device) -> Any:
    return pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, value)


def _to_cpu(value: Any) -> Any:
    return _to(value, torch.device("cpu"))
