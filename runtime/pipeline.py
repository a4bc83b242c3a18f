"""`Pipeline`: the user API that `LocalPipeline` and `DistributedPipeline` share, written once
(the user-facing API: docs/training.md).

A subclass says only how its stages are reached: LocalPipeline holds every stage in this
process (one lane per tensor-parallel index, every replica run in turn), DistributedPipeline
this rank's stages, the others over torch.distributed.  It answers the hooks below; the
rest (modes, weights, checkpoints, clipping, the optimizer, the loss default, the batch
split) is here.

    train_step, evaluate, pipe(inputs):
      1. `_stepping()`: count the call ([Note: dropout streams] in modes.py; [Note: step
         numbers] in steps.py)
      2. `_split`: the loss function (the model file's by default, where the last stage runs),
         the microbatch count ([Note: short batch] in counts.py), each replica's microbatches
         and their weights ([Note: microbatch weights] in microbatches.py)
      3. `_begin`: the ranks agree on the step (`_check_step`), the bf16 weights follow
         their masters.  With local=True (each replica given only its own rows) steps 2
         and 3 swap: the ranks agree on the step, then on every replica's rows
         (`_agree_rows`, [Note: local rows] in local_rows.py)
      4. the subclass runs its schedule: `_run_train`, `_run_evaluate`, `_run_forward`
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Generic, Mapping, Sequence, TypeVar

import torch

from . import checkpoint, clip, initialize, local_rows, microbatches, optim, package, precision, weights
from .memory import MemoryStats, MemoryTracker
from .counts import Counts
from .errors import BatchError
from .manifest import Manifest
from .stage import StageRunner

__all__ = ["Pipeline", "Batch", "LossFn", "named_once", "share_tied"]

LossFn = Callable[[Any, Any], torch.Tensor]
Order = TypeVar("Order")  # what a subclass builds per microbatch count: its lowered schedule
P = TypeVar("P", bound="Pipeline[Any]")


@dataclass(frozen=True)
class Batch:
    """One call's batch as this process runs it (step 2): each of its replicas' microbatches,
    every replica cut alike."""

    rows: list[int]  # each microbatch's rows (of one replica)
    scales: list[float]  # what each microbatch's mean loss is divided by ([Note: microbatch weights])
    inputs: dict[int, list[dict[str, Any]]]  # replica -> its microbatches' inputs
    targets: dict[int, list[Any]] = field(default_factory=dict)  # replica -> its targets (none: forward only)
    loss_fn: LossFn | None = None  # None where this process runs no last stage
    local: bool = False  # the rows of this process's replica only ([Note: local rows] in local_rows.py)

    @property
    def count(self) -> int:
        """How many microbatches each replica runs."""
        return len(self.rows)


class Pipeline(ABC, Generic[Order]):
    """A compiled package DIR run as a pipeline; the subclasses say where its stages run."""

    directory: Path
    manifest: Manifest
    training: bool
    replica: int = 0  # this process's data-parallel index (LocalPipeline runs every replica: 0)
    _masters: precision.MasterWeights | None
    _counts: Counts[Order]

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.manifest = package.load_manifest(directory)
        self.training = True
        self._loss_fn: LossFn | None = None
        self._memory = MemoryTracker(self._all_parameters)

    # -- the hooks -----------------------------------------------------------------------------

    @abstractmethod
    def _runners(self) -> list[StageRunner]:
        """Every stage runner this process holds (every lane's)."""

    @abstractmethod
    def _module_named(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(original name, stage module parameter), each parameter once (lane by lane)."""

    @abstractmethod
    def _held(self) -> list[tuple[weights.Held, torch.Tensor]]:
        """Every stage tensor this process holds, as the user sees it (masters under bf16)."""

    @abstractmethod
    def _checkpoint_view(self) -> checkpoint.View:
        """What the checkpoint code sees of this process."""

    @abstractmethod
    def _replicas(self) -> Sequence[int]:
        """The data-parallel replicas this process runs."""

    @abstractmethod
    def _stepping(self) -> ContextManager[Any]:
        """Step 1: count a call around its whole run, inside `self._memory.window()` (the
        call's memory, when tracked: [Note: measured memory] in memory.py)."""

    @abstractmethod
    def _norm_term(self, p: float) -> torch.Tensor:
        """The whole model's gradient norm term (clip.norm_term), reduced over every piece."""

    @abstractmethod
    def _run_train(self, batch: Batch) -> torch.Tensor:
        """Step 4 of train_step: the schedule run; the whole-batch loss."""

    @abstractmethod
    def _run_evaluate(self, batch: Batch) -> torch.Tensor:
        """Step 4 of evaluate (under no_grad): the whole-batch loss."""

    @abstractmethod
    def _run_forward(self, batch: Batch) -> list[Any]:
        """Step 4 of pipe(inputs) (under no_grad): every microbatch's output, replica by replica."""

    def _check_step(self) -> None:
        """Step 3: the ranks agree on the step (nothing to agree on in one process)."""

    def _recover_ranks(self) -> None:
        """What `recover` does beyond forgetting the microbatches (nothing in one process)."""

    def _agree_rows(self, rows: int | None, missing: tuple[bool, bool]) -> list[int]:
        """Every replica's rows with local=True, given this process's replica's (None: not
        known here) and what it lacks ([Note: local rows] in local_rows.py).  In one process
        (LocalPipeline) every replica runs, so one replica's rows are a whole batch only
        with dp = 1; with dp > 1 local=True is refused (pass the global batch, or run
        DistributedPipeline, where each rank is one replica)."""
        if self.replicas > 1:
            raise BatchError(f"local=True gives one replica's rows, but this LocalPipeline runs all "
                             f"{self.replicas} data-parallel replicas in one process: pass the whole global batch "
                             f"(local=False), or run the package with runtime.DistributedPipeline under torchrun, "
                             f"where each rank is one replica.")
        agreement = local_rows.Agreement(1)
        return agreement.decode(agreement.encode(0, rows, 0, missing), self._default_rows())

    def _zero_group(self) -> Any:
        """The process group an optimizer's state is sharded over (None: not sharded)."""
        return None

    # -- the contract --------------------------------------------------------------------------

    @property
    def replicas(self) -> int:
        """The data-parallel degree: how many replicas share a global batch."""
        return self.manifest.mesh.dp

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        """Take this process's tensors (each stage's, each lane's or rank's shards) from the
        ORIGINAL model's state_dict (not collective)."""
        if strict:
            weights.check_state_dict(state_dict, self.manifest)
        weights.load_stage_state(self._held(), state_dict, self.manifest)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full original state_dict (original names and alias keys), reassembled."""
        return weights.assemble_state_dict(self._held(), self.manifest)

    def parameters(self) -> list[torch.nn.Parameter]:
        """This process's parameters, each once (a tied parameter is one shared object), for
        its optimizer."""
        return [p for _, p in self.named_parameters()]

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(original name, parameter) for this process's parameters, each once (the masters
        under bf16); LocalPipeline with tp > 1 lists them lane by lane, so a name comes once
        per lane (a shard, or a replicated copy, of that parameter)."""
        return precision.shown(self._masters, self._module_named())

    def train(self: P, mode: bool = True) -> P:
        """This process's stage modules (every lane's) in training mode, or eval mode: as
        nn.Module.train (under DistributedPipeline every rank calls it, as every rank runs
        the steps)."""
        self.training = bool(mode)
        for r in self._runners():
            r.module.train(mode)
        return self

    def eval(self: P) -> P:
        """`train(False)`."""
        return self.train(False)

    def train_step(self, inputs: Any, target: Any, loss_fn: LossFn | None = None, *,
                   local: bool = False) -> torch.Tensor:
        """One step over the whole (global) batch: leaves .grad as loss.backward() on the
        whole-batch mean loss would (accumulating; grads are not zeroed); returns that loss,
        detached, on every rank.  DistributedPipeline: collective; after a failed step every
        rank refuses the next ones until `recover()` ([Note: step numbers] in steps.py).

        local=True: `inputs` and `target` hold only this replica's rows (those of
        DistributedSampler(num_replicas=pipe.replicas, rank=pipe.replica)); a rank whose
        stages read no model input may pass None for inputs, one without the last stage None
        for target; the loss is still the global batch's mean ([Note: local rows] in
        local_rows.py).  LocalPipeline takes local=True only with dp = 1 (`_agree_rows`)."""
        with self._stepping():
            batch = self._prepare(inputs, target, loss_fn, local, True)
            return self._run_train(batch)

    def evaluate(self, inputs: Any, target: Any, loss_fn: LossFn | None = None, *,
                 local: bool = False) -> torch.Tensor:
        """The whole-batch loss (on every rank), forward only and without an autograd graph
        (in the current mode: call eval() first for dropout off and batch norm's running
        statistics).  DistributedPipeline: collective, no outputs gathered (the last stage's
        ranks compute their microbatches' losses).  local=True: as in `train_step`."""
        with self._stepping():
            batch = self._prepare(inputs, target, loss_fn, local, True)
            with torch.no_grad():
                return self._run_evaluate(batch)

    def __call__(self, inputs: Any, *, local: bool = False) -> Any:
        """Forward only: the whole (global) batch's output (microbatch outputs concatenated
        along their batch dimension).  DistributedPipeline: on every rank, on CPU (collective).
        local=True: `inputs` are this replica's rows (None on a rank whose stages read no
        model input), and the output is this replica's rows of it."""
        with self._stepping():
            batch = self._prepare(inputs, None, None, local, False)
            with torch.no_grad():
                outs = self._run_forward(batch)
            return microbatches.concat_outputs(outs, self.manifest.output_batch_dims)

    def recover(self) -> None:
        """After a failed step: forget whatever microbatches it left.  DistributedPipeline
        (StepError on every rank): also agree on the step count and accept steps again
        (collective: every rank calls it); gradients are left as they are: zero them before
        the next step.  LocalPipeline has it for the same code: one process cannot fall out
        of step, so a failed step is never refused there."""
        for r in self._runners():
            r.clear()
        self._recover_ranks()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ of the original model (DistributedPipeline:
        collective): the whole model's gradient norm (each parameter once, [Note: counting
        each parameter once] in clip.py), returned on every rank, and every lane's and
        rank's gradients scaled by the same coefficient."""
        p = clip.check_norm_type(norm_type)
        params = self.parameters()
        total = clip.total_norm(self._norm_term(p), p, clip.grad_dtype(params))
        clip.clip_(params, total, max_norm, p, error_if_nonfinite)
        return total

    def make_optimizer(self, cls: type[torch.optim.Optimizer], params: optim.ParamGroups = None,
                       **defaults: Any) -> torch.optim.Optimizer:
        """`cls` over this process's parameters (every lane's), groups by original name
        ([Note: parameter groups by original name] in optim.py)."""
        opt = optim.make_optimizer(cls, self.named_parameters(), self.manifest, params, self._zero_group(), **defaults)
        self._memory.watch(opt)
        return opt

    # -- memory (runtime/memory.py) ------------------------------------------------------------

    def track_memory(self, on: bool = True) -> None:
        """Measure the next steps' memory (each train_step, evaluate or pipe(inputs), with the
        step of an optimizer from make_optimizer after it) until `track_memory(False)`; a step
        without tracking costs nothing ([Note: measured memory] in memory.py)."""
        self._memory.on = bool(on)

    def memory_stats(self) -> MemoryStats:
        """This process's peak bytes in its last tracked step by kind, and the total, beside
        the plan's prediction for the stages it holds ([Note: measured memory] in memory.py);
        NotTrackedError if no step was tracked."""
        return self._memory.stats(self._predicted_bytes())

    def _predicted_bytes(self) -> int:
        """The plan's peak bytes for this process's stages, summed (0: the plan has none)."""
        predicted = self.manifest.predicted
        held = {r.entry.index for r in self._runners()}
        return sum(predicted.stages[k].memory_bytes for k in held if k < len(predicted.stages)) if predicted else 0

    def _all_parameters(self) -> list[torch.nn.Parameter]:
        """The stage modules' parameters and, under bf16, their masters: each once."""
        every = [p for _, p in self._module_named()] + self.parameters()
        return list({id(p): p for p in every}.values())

    # -- checkpoints (runtime/checkpoint/; docs/checkpoints.md) --------------------------------

    def save_checkpoint(self, path: str | Path, optimizer: torch.optim.Optimizer | None = None, extra: Any = None,
                        keep: int | None = None) -> Path:
        """Write checkpoint PATH (atomic: complete or invisible; original names, global shapes,
        optimizer, `extra`, RNG; DistributedPipeline: from every rank in parallel, collective);
        with `keep`, then remove all but the newest `keep` checkpoints beside it."""
        return checkpoint.save(self._checkpoint_view(), path, optimizer, extra, keep)

    def load_checkpoint(self, path: str | Path, optimizer: torch.optim.Optimizer | None = None,
                        strict: bool = True) -> Any:
        """Restore a checkpoint of `save_checkpoint` from any plan of the model
        (DistributedPipeline: collective; each rank reads only its own tensors and slices);
        returns its `extra`."""
        return checkpoint.load(self._checkpoint_view(), path, optimizer, strict)

    def init_weights(self, seed: int = 0) -> None:
        """Initialise this process's parameters (its shards only) with the values they have on
        every plan: runtime.init_weights(model, seed) on the unsplit model gives the same."""
        initialize.init_pipeline(self._checkpoint_view().held, self.manifest, self.directory, seed)

    # -- steps 2 and 3 -------------------------------------------------------------------------

    def _split(self, inputs: Any) -> Batch:
        """Step 2 without a target: the count for this batch's rows and each replica's
        microbatch inputs."""
        m, replicas = self.manifest, self._replicas()
        count = self._counts.fit(microbatches.replica_rows(inputs, m))
        rows = microbatches.microbatch_rows(inputs, m, count)
        cut = {r: microbatches.split_inputs(inputs, m, r, count) for r in replicas}
        return Batch(rows, microbatches.loss_scales(rows, len(replicas), m.loss_reduction, m.mesh.dp), cut)

    def _prepare(self, inputs: Any, target: Any, loss_fn: LossFn | None, local: bool, with_target: bool) -> Batch:
        """Steps 2 and 3: the global batch is cut before the ranks meet (a wrong batch fails
        on its rank alone, before any message); local rows are agreed on after the step
        check, as the agreement is itself a collective ([Note: local rows] in local_rows.py)."""
        if local:
            self._begin()
            return self._split_local(inputs, target, loss_fn, with_target)
        batch = self._split_with_target(inputs, target, loss_fn) if with_target else self._split(inputs)
        self._begin()
        return batch

    def _split_local(self, inputs: Any, target: Any, loss_fn: LossFn | None, with_target: bool) -> Batch:
        """Step 2 for this replica's own rows: every replica's rows agreed on, the count the
        smallest fits, this replica's microbatches weighted by the global row count
        ([Note: local rows] in local_rows.py); None where this process's stages read nothing."""
        m, needs = self.manifest, local_rows.Needs.of(self._runners(), with_target)
        every = self._agree_rows(local_rows.given_rows(inputs, target, m), needs.missing(inputs, target))
        count = self._counts.fit(min(every))
        mine = every[self.replica]
        rows = local_rows.microbatch_rows(mine, count)
        cut = microbatches.split_inputs(inputs, m, 0, count, replicas=1) if needs.inputs else [{} for _ in rows]
        targets = microbatches.split_target(target, count, batch_size=mine) if needs.target else [None] * count
        fn = (loss_fn or self._default_loss_fn()) if needs.target else None
        return Batch(rows, local_rows.scales(rows, sum(every), len(every), m.loss_reduction), {self.replica: cut},
                     {self.replica: targets} if with_target else {}, fn, local=True)

    def _default_rows(self) -> int:
        """A replica's rows when no batched value says: the example batch's share."""
        m = self.manifest
        return (m.batch_size or m.microbatches * m.mesh.dp) // m.mesh.dp

    def _split_with_target(self, inputs: Any, target: Any, loss_fn: LossFn | None) -> Batch:
        """Step 2: the loss function (only a last stage needs one), then `_split` and each
        replica's microbatch targets."""
        fn = loss_fn or (self._default_loss_fn() if any(r.is_last for r in self._runners()) else None)
        batch = self._split(inputs)
        dp, total = self.manifest.mesh.dp, sum(batch.rows) * self.manifest.mesh.dp
        targets = {r: microbatches.split_target(target, batch.count, r, dp, total) for r in batch.inputs}
        return dataclasses.replace(batch, targets=targets, loss_fn=fn)

    def _begin(self) -> None:
        """Step 3, before the stages run: the ranks agree on the step, and the bf16 weights
        are brought up to date with their masters."""
        self._check_step()
        if self._masters is not None:
            self._masters.refresh()

    def _default_loss_fn(self) -> LossFn:
        """The model file's `loss_fn`, loaded once."""
        if self._loss_fn is None:
            self._loss_fn = package.load_loss_fn(self.manifest, self.directory)
        return self._loss_fn


def named_once(runners: Sequence[StageRunner]) -> list[tuple[str, torch.nn.Parameter]]:
    """(original name, stage module parameter) of `runners`, each parameter (a tied one
    shared by several stages) once, in first-seen order."""
    seen: dict[int, tuple[str, torch.nn.Parameter]] = {}
    for r in runners:
        for spec in r.entry.parameters:
            p = getattr(r.module, spec.name)
            seen.setdefault(id(p), (spec.source_name, p))
    return list(seen.values())


def share_tied(runners: Sequence[StageRunner]) -> None:
    """Make the copies of each tied parameter among `runners` (stages on one device) one
    shared nn.Parameter, the first stage's: their gradients then sum by themselves."""
    shared: dict[str, torch.nn.Parameter] = {}
    for r in runners:
        for spec in r.entry.parameters:
            p = getattr(r.module, spec.name)
            first = shared.setdefault(spec.source_name, p)
            if first is not p:
                setattr(r.module, spec.name, first)
