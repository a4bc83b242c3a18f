"""`DistributedPipeline`: one process per rank under torchrun (the user-facing contract: README.md, "Use").

Global rank = (replica * pp + position) * tp + t (groups.Mesh); stage s sits at position
s % pp, or in a V under zb-v ([Note: V placement] in schedule/registry.py), so with the interleaved
and zb-v schedules a rank holds several (virtual) stages, and the
tp ranks t = 0..tp-1 of a position are neighbours that each hold their own shards of the
same stages (the same stage files; [Note: shards] in weights.py).  Each rank imports only
its own stage files and interprets its own row of the lowered schedule:

    train_step on one rank (steps 1-3 of pipeline.py's, then):
      1. take replica r's rows of the global batch (local=True: given only those), split into M microbatches
      2. for each action of this rank's row (schedule.lower + validate):
           F / B            as in LocalPipeline (stage.py); the last stage adds the loss.
                            The stage code's tp.* collectives (tp.py) run inside, over
                            this position's tensor-parallel group: every tp rank runs the
                            same row, so they meet in the same order
           SEND_F / SEND_B  isend the edge's values (shape, dtype from the manifest; tp
                            rank t sends its own local tensors to tp rank t) as one
                            message (messages.py), wait at 7; on CUDA from the
                            communication stream ([Note: communication stream] in
                            devices.py)                                       (p2p.py)
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

Faults: every wait has a timeout (PIPELINE_TIMEOUT_S, default 60 s) and a failed or silent
peer becomes a `PeerError` naming this rank, its stage, the action, the microbatch and the
peer ([Note: injected faults] in faults.py: the test hooks).  engine="pipelining": engines/pipelining.py.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from . import checkpoint, clip, engines, faults, local_rows, modes, offload, optim, outputs, package, precision, tp, weights
from .comm import guard, init_from_env, timeout_from_env, wait
from .counts import Counts
from .devices import CommStream
from .edges import Edges
from .groups import Mesh, make_groups
from .p2p import HandOvers, Receive, Sent
from .pipeline import Batch, LossFn, Pipeline, named_once, share_tied
from .rank_schedule import Rows, rows_builder
from .schedule import Action, Kind, Schedule, StageGraph
from .stage import StageRunner, as_leaf, to_device
from .steps import StepGuard
from .tracing import Tracer
from .world import Now, check_ranks, check_same_package, check_world, describer, grad_sync, tp_describer

__all__ = ["DistributedPipeline"]


@dataclass
class _Step:
    """What one step keeps between actions on this rank."""

    train: bool
    evaluate: bool = False  # forward only, the loss kept instead of the outputs
    outputs: dict[tuple[int, int], dict[str, torch.Tensor]] = field(default_factory=dict)
    received: dict[tuple[int, int], dict[str, torch.Tensor]] = field(default_factory=dict)
    in_grads: dict[tuple[int, int], dict[str, torch.Tensor | None]] = field(default_factory=dict)
    out_grads: dict[tuple[int, int], dict[str, torch.Tensor]] = field(default_factory=dict)
    sends: list[Sent] = field(default_factory=list)
    posted: dict[Action, Receive | None] = field(default_factory=dict)  # receives posted ahead
    loss: torch.Tensor | None = None
    results: list[Any] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # each microbatch's rows ([Note: free batch])
    scales: list[float] = field(default_factory=list)  # [Note: microbatch weights]


class DistributedPipeline(Pipeline[Rows]):
    """Run this rank's stages of package DIR; every rank calls every method (collectively)."""

    def __new__(cls, directory: str | Path, *, engine: str = "partitioner", **options: Any) -> DistributedPipeline:
        return super().__new__(engines.engine_class(cls, engine))

    def __init__(self, directory: str | Path, *, schedule: str | Schedule | None = None, timeout_s: float | None = None,
                 trace: str | Path | None = None, engine: str = "partitioner") -> None:
        # 1. the manifest and the process group
        super().__init__(directory)
        m = self.manifest
        self.timeout_s = timeout_from_env(timeout_s)
        self.mesh = Mesh.from_manifest(m)
        self.pp, self.tp, self.dp = self.mesh.pp, self.mesh.tp, self.mesh.dp
        given = os.environ.get("WORLD_SIZE", "")
        if not dist.is_initialized() and given.isdigit():
            check_world(self.mesh, self.directory, int(given))  # before joining: a clear error, not a hang
        self.device = init_from_env(self.timeout_s)
        self._comm = CommStream(self.device)  # what the pipeline's messages are posted from
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        check_world(self.mesh, self.directory, self.world)
        check_same_package(m, self.directory, self.rank, self.world)
        # 2. where this rank sits; every process group ([Note: process groups] in comm.py)
        self.graph = g = StageGraph.from_manifest(m)
        self.replica, self.position, self.tp_index = self.mesh.coords(self.rank)
        check_ranks(m, self.mesh, g)
        self.stages = [s for s in range(g.num_stages) if g.rank_of(s) == self.position]
        self._describe = describer(self.rank, self.stages)  # (holds no self: see world.describer)
        self._now = Now()  # the action running now, for tp's error messages
        self.groups = make_groups(m, g, self.rank)
        self._set_tp_group()
        # 3. this rank's stages (tied copies within the rank are one shared Parameter)
        self.runners = {s: StageRunner(package.import_stage(directory, m, s).to(self.device), m.stages[s], m.precision)
                        for s in self.stages}
        share_tied([self.runners[s] for s in self.stages])
        # float32 masters of bf16 parameters ([Note: bf16 with master weights] in precision.py)
        self._masters = precision.masters_for([p for _, p in self._module_named()], m.precision)
        # 4. gradient buckets, tied gradients
        self._ties, self._buckets, plain = grad_sync(self._module_named(), self.groups, self.dp, self.timeout_s,
                                                     self._describe)
        # 5. the schedule: every rank lowers and validates the whole one, then keeps its row;
        # a short batch's smaller count is made when one comes ([Note: short batch] in counts.py)
        self._counts = Counts(rows_builder(schedule, m, g, self.position, self._comm.stream is None, self.runners,
                                           plain), m.microbatches, fixed=isinstance(schedule, list))
        self.tracer = Tracer(trace or os.environ.get("PIPELINE_TRACE") or None, self.rank, self.stages)
        self._fault = faults.from_env()  # test hooks: [Note: injected faults] in faults.py
        # the calls of train_step, evaluate and __call__, checked across ranks ([Note: step numbers] in steps.py)
        self._steps = StepGuard(self.groups.world, self.rank, self.world, self.device, self.timeout_s,
                                self._describe("the step check", range(self.world)))
        # the point-to-point hand-overs of this rank's stages (p2p.py), each edge's specs made once
        ranks = [self.mesh.rank(self.replica, g.rank_of(s), self.tp_index) for s in range(g.num_stages)]
        self._p2p = HandOvers(Edges(m), self.groups.edges, ranks, self.rank, self._comm, self.device, self._steps,
                              self.timeout_s)

    # -- the contract ------------------------------------------------------------------------

    def state_dict(self, rank: int | None = None) -> dict[str, torch.Tensor]:
        """The full original state_dict on every rank, on CPU (collective); with `rank`, on that
        rank only (the others get {} and never hold the whole model)."""
        mine = [(spec, t.detach().cpu()) for spec, t in self._held()]
        gathered: list[Any] = [None] * self.world
        if rank is None:
            dist.all_gather_object(gathered, mine if self.replica == 0 else [], group=self.groups.world)
        else:
            dist.gather_object(mine if self.replica == 0 else [], gathered if self.rank == rank else None, dst=rank,
                               group=self.groups.world)
            if self.rank != rank:
                return {}
        return weights.assemble_state_dict([p for pieces in gathered for p in pieces], self.manifest)

    def make_optimizer(self, cls: type[torch.optim.Optimizer], params: optim.ParamGroups = None,
                       **defaults: Any) -> torch.optim.Optimizer:
        """`cls` over this rank's parameters, groups by original name, the same groups on
        every rank ([Note: parameter groups by original name] in optim.py); with `--zero 1`,
        its state sharded across this rank's data-parallel replicas ([Note: ZeRO-1] there)."""
        opt = super().make_optimizer(cls, params, **defaults)
        self.tracer.watch(opt)
        return opt

    def _reduce_loss(self, step: _Step) -> torch.Tensor:
        """The whole-batch loss on every rank: the last stages' sums over the world, / dp."""
        # every tp rank of the last stage has the same loss: t == 0 counts it
        loss = step.loss if step.loss is not None and self.tp_index == 0 else torch.zeros((), device=self.device)
        self._all_reduce(loss, dist.ReduceOp.SUM, "loss all_reduce")
        return loss / self.dp

    # -- the hooks of Pipeline (pipeline.py) -----------------------------------------------------

    def _runners(self) -> list[StageRunner]:
        return list(self.runners.values())

    def _module_named(self) -> list[tuple[str, torch.nn.Parameter]]:
        return named_once([self.runners[s] for s in self.stages])

    def _held(self) -> list[tuple[weights.Held, torch.Tensor]]:
        """This rank's stages' parameters and persistent buffers (its shards), masters under bf16."""
        return [p for r in self.runners.values()
                for p in precision.shown(self._masters, weights.stage_tensors(r.module, r.entry, self.tp_index))]

    def _checkpoint_view(self) -> checkpoint.View:
        return checkpoint.View(self.manifest, self._held(), rank=self.rank, world=self.world, distributed=True,
                               directory=self.directory, group=self.groups.world)

    def _replicas(self) -> list[int]:
        return [self.replica]  # this rank's replica only

    @contextlib.contextmanager
    def _stepping(self) -> Iterator[None]:
        """Count the call, checked across ranks ([Note: step numbers] in steps.py); tp.* is
        process-wide: several pipelines in one process take turns."""
        with self._steps.step(), self._memory.window():
            self._set_tp_group()
            yield

    def _check_step(self) -> None:
        self._steps.check()

    def _recover_ranks(self) -> None:
        if self._buckets is not None:
            self._buckets.reset()
        self._steps.recover()

    def _zero_group(self) -> Any:
        """With `--zero 1`, this rank's data-parallel group ([Note: ZeRO-1] in optim.py)."""
        return self.groups.dp if self.dp > 1 and optim.zero_stage(self.manifest) == 1 else None

    def _norm_term(self, p: float) -> torch.Tensor:
        """This rank's term, all-reduced over the world."""
        counted = clip.counted_names(self.manifest, self.stages, self.tp_index, self.replica)
        term = clip.norm_term(self.named_parameters(), counted, p, self.device)
        self._all_reduce(term, dist.ReduceOp.MAX if p == float("inf") else dist.ReduceOp.SUM,
                         "gradient norm all_reduce")
        return term

    def _run_train(self, batch: Batch) -> torch.Tensor:
        """Steps 2-5 of the module's docstring."""
        order = self._counts.get(batch.count)
        snapshot = self._ties.snapshot()
        if self._buckets is not None:
            self._buckets.reset()
        step = _Step(train=True, rows=batch.rows, scales=batch.scales)
        try:
            self._run(order.train, order.train_ahead, step, batch.inputs[self.replica], batch.targets[self.replica],
                      batch.loss_fn, order.arm_at)
            self._p2p.wait_sends(step.sends)
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

    def _run_evaluate(self, batch: Batch) -> torch.Tensor:
        order = self._counts.get(batch.count)
        step = _Step(train=False, evaluate=True, rows=batch.rows, scales=batch.scales)
        self._run(order.forward, order.forward_ahead, step, batch.inputs[self.replica], batch.targets[self.replica],
                  batch.loss_fn)
        self._p2p.wait_sends(step.sends)
        loss = self._reduce_loss(step)
        self.tracer.flush()
        return loss

    def _run_forward(self, batch: Batch) -> list[Any]:
        """Every replica's outputs (with local rows: this replica's), gathered from the last
        stage's ranks (t = 0) to every rank."""
        order = self._counts.get(batch.count)
        step = _Step(train=False, rows=batch.rows)
        self._run(order.forward, order.forward_ahead, step, batch.inputs[self.replica], None, None)
        self._p2p.wait_sends(step.sends)
        last = self.graph.rank_of(self.graph.num_stages - 1)
        mine = [to_device(o, torch.device("cpu")) for o in step.results] if self.position == last and self.tp_index == 0 else None
        gathered = self._gather_outputs(mine)
        replicas = [self.replica] if batch.local else range(self.dp)
        return [o for r in replicas for o in gathered[self.mesh.rank(r, last, 0)]]

    def _gather_outputs(self, mine: list[Any] | None) -> list[Any]:
        """Every rank's `mine` (its last stage's outputs, or None), a class of the model file
        read from this rank's own import of it ([Note: output classes] in
        partitioner/trace/outputs.py)."""
        return outputs.all_gather(mine, self.world, self.groups.world,
                                  lambda: package.load_model_file(self.manifest, self.directory))

    def _agree_rows(self, rows: int | None, missing: tuple[bool, bool]) -> list[int]:
        """Every replica's rows: one all-reduce (MAX) over the world ([Note: local rows] in local_rows.py)."""
        agreement = local_rows.Agreement(self.dp)
        vector = agreement.encode(self.replica, rows, self.rank, missing).to(self.device)
        self._all_reduce(vector, dist.ReduceOp.MAX, "local rows all_reduce")
        return agreement.decode(vector.cpu(), self._default_rows())

    def _all_reduce(self, tensor: torch.Tensor, op: Any, what: str) -> None:
        """`tensor` all-reduced in place over the world, traced and timed."""
        doing = self._describe(f"the {what}", range(self.world))
        with self.tracer.collective(what):
            with guard(doing):
                work = dist.all_reduce(tensor, op=op, group=self.groups.world, async_op=True)
            wait(work, self.timeout_s, doing)

    # -- the interpreter ---------------------------------------------------------------------

    def _run(self, actions: list[Action], ahead: dict[int, tuple[int, ...]], step: _Step,
             mb_inputs: list[dict[str, Any]], targets: list[Any] | None, loss_fn: LossFn | None,
             arm_at: dict[int, list[torch.nn.Parameter]] | None = None) -> None:
        """Run this rank's row of actions; before each compute, post the receives of the
        next (`ahead`: [Note: receives posted ahead] in schedule/lowering.py) and bring back what
        the B, I or W ahead offloaded (`back`); before each stage's last B (or W) arm its buckets."""
        back = offload.prefetches(actions, offload.ahead())
        for t, a in enumerate(actions):
            if arm_at and t in arm_at and self._buckets is not None:
                self._buckets.arm(arm_at[t])
            for j in ahead.get(t, ()):
                step.posted[actions[j]] = self._post_recv(actions[j], step)
            offload.bring_back(back.get(t, ()), self.runners)
            self._execute(a, step, mb_inputs, targets, loss_fn)

    def _execute(self, a: Action, step: _Step, mb_inputs: list[dict[str, Any]], targets: list[Any] | None,
                 loss_fn: LossFn | None) -> None:
        if self._fault is not None:
            self._fault.check(self.rank, a, self._steps.call)
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
            loss = runner.loss(i, out, to_device(targets[i], self.device), loss_fn, step.scales[i], keep=step.train)
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
        """Post the send of `a`: the outputs forward, or the input grads back (p2p.py)."""
        key, specs = (a.stage, a.microbatch), self._p2p.edge(a).specs
        if a.kind == Kind.SEND_F:
            values: list[torch.Tensor | None] = [step.outputs[key][spec.name].detach() for spec in specs]
        else:
            grads = step.in_grads.get(key, {})
            values = [grads.pop(spec.name, None) for spec in specs]
        sent = self._p2p.send(a, values, step.rows[a.microbatch])
        if sent is not None:
            step.sends.append(sent)  # kept until waited on: [Note: communication stream] rule 2

    def _post_recv(self, a: Action, step: _Step) -> Receive | None:
        """Post the receive of `a` into a fresh buffer (None: nothing flows on its edge)."""
        return self._p2p.post(a, step.rows[a.microbatch])

    def _recv(self, a: Action, step: _Step) -> None:
        """Wait for the receive of `a` (posted now unless it was posted ahead) and file its values."""
        got = step.posted.pop(a) if a in step.posted else self._post_recv(a, step)
        if got is None:
            return
        key = (a.stage, a.microbatch)
        for spec, value in self._p2p.wait(a, got):
            if a.kind == Kind.RECV_F:
                step.received.setdefault(key, {})[spec.name] = as_leaf(value, spec.requires_grad)
            else:
                have = step.out_grads.setdefault(key, {})
                have[spec.name] = value if spec.name not in have else have[spec.name] + value

    def _set_tp_group(self) -> None:
        """Point tp.* at this (replica, position)'s tensor-parallel group (none when tp == 1),
        its error wording reading the action running now from `self._now` (world.tp_describer)."""
        if self.tp == 1:
            tp.reset()
            return
        doing = tp_describer(self._now, self.rank, self.tp_index, self.groups.tp_ranks, self.timeout_s)
        tp.set_group(self.groups.tp, self.tp_index, self.tp, self.timeout_s, doing)
