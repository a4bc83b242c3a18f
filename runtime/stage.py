"""One stage's forward and backward per microbatch: what both pipelines run.

[Note: stage boundaries at run time]
    A value entering a stage from another stage becomes a fresh leaf (detached, with
    `requires_grad` set when it needs a gradient), so each stage's autograd graph ends at
    its own inputs.  Backward of microbatch i feeds the gradients of the stage's outputs
    (the SUM over every later stage that read the value) into
    `torch.autograd.backward`, which leaves the gradients of the stage's inputs in those
    leaves' `.grad`, to be passed back to their producers.  The last stage starts from
    `loss_fn(output, target_i) / scale` instead.

[Note: split backward]
    The zero-bubble schedules (zero_bubble.py) split B in two actions.  I
    (`backward_input`) runs `torch.autograd.grad` from the same roots and output
    gradients as B, with respect to the stage's input leaves only, keeping the graph
    (retain_graph): the input gradients, nothing accumulated into any `.grad`.  W
    (`backward_weight`) later runs `torch.autograd.backward` from the same roots with
    `inputs=` the stage's parameters, which accumulates their `.grad` and frees the
    graph.  Each gradient is the one the fused B computes (the same chain rule over the
    same graph; tests compare them at rtol 1e-5).  W does not walk the graph again from
    the outputs: I records the gradient at each node where a weight's edge leaves the
    path to the inputs, and W starts there ([Note: weight-gradient seeds] in
    split_backward.py), so I + W costs about what B does.  Where that cannot be exact
    (a weight reached by two such edges, a stage whose inputs need no gradient, or
    recomputation, whose checkpointed forward would run once more) W walks the whole
    graph again from the outputs, computing the input path twice.  A microbatch's
    activations live until its W.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.utils._pytree

from . import modes, split_backward
from .offload import Offloader
from .errors import PipelineError
from .recompute import run_checkpointed
from .manifest import StageSpec
from .precision import autocast, cast_inputs, device_type, loss_input

__all__ = ["StageRunner", "as_leaf", "to_device"]


def as_leaf(value: Any, requires_grad: bool) -> Any:
    """A detached copy-free leaf of `value`, requiring grad when asked and possible."""
    if not isinstance(value, torch.Tensor):
        return value
    leaf = value.detach()
    if requires_grad and (leaf.is_floating_point() or leaf.is_complex()):
        leaf.requires_grad_(True)
    return leaf


def to_device(value: Any, device: torch.device) -> Any:
    """Every tensor leaf of `value` moved to `device`; other leaves as they are."""
    return torch.utils._pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, value)


@dataclass
class _Saved:
    args: list[Any]
    outputs: Any
    loss: torch.Tensor | None = None
    roots: list[torch.Tensor] | None = None  # set by I, for W: [Note: split backward]
    root_grads: list[torch.Tensor] | None = None
    seeds: split_backward.Seeds | None = None  # W's starting points, found by I


@dataclass
class StageRunner:
    """Runs stage `entry.index` (its nn.Module and manifest entry) microbatch by microbatch."""

    module: torch.nn.Module
    entry: StageSpec
    precision: str = "fp32"  # the manifest's: forward and loss under its autocast ([Note: mixed precision])
    #                          or in bfloat16 ([Note: bf16 with master weights])
    _saved: dict[int, _Saved] = field(default_factory=dict)
    offloader: Offloader | None = None  # with the manifest's `offload` ([Note: activation offloading])

    def __post_init__(self) -> None:
        if self.entry.offload > 0:
            self.offloader = Offloader(self.entry.offload)

    @property
    def index(self) -> int:
        return self.entry.index

    @property
    def is_last(self) -> bool:
        return self.entry.is_last

    @property
    def output_names(self) -> list[str]:
        return [o.name for o in self.entry.outputs]

    @property
    def recompute(self) -> str | None:
        """The stage's recomputation policy: "full", "selective" or None ([Note: recomputation
        policies] in recompute.py)."""
        return self.entry.recompute

    def forward(self, microbatch: int, args: list[Any], train: bool, seed: int | None = None) -> Any:
        """The stage's outputs for one microbatch: a tuple (one per manifest output) or,
        on the last stage, the model's output structure.  `train` keeps what backward needs.

        [Note: recomputation] With `recompute`, a training forward runs under
        torch.utils.checkpoint (non-reentrant): autograd keeps only the stage's inputs
        (and, "selective", the outputs of its matmuls) and runs the forward again (same
        RNG state) when this microbatch's backward needs its activations, so gradients
        are those of the plain forward ([Note: recomputation policies] in recompute.py).

        `seed`: in training mode, the forward draws from a generator seeded by it
        ([Note: dropout streams] in modes.py).  Under `bf16` the batch's float32 inputs are
        cast to bfloat16 ([Note: bf16 with master weights] in precision.py).
        """
        args = [cast_inputs(a, self.precision) if spec.from_batch else a for a, spec in zip(args, self.entry.inputs)]
        with autocast(self.precision, device_type(args)):
            if seed is not None and self.module.training:
                device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
                with modes.seeded(seed, device):
                    out = self._call(microbatch, args, train)
            else:
                out = self._call(microbatch, args, train)
        if not self.is_last:
            n = len(self.entry.outputs)
            if not isinstance(out, (tuple, list)) or len(out) != n:
                got = f"a {type(out).__name__}" + (f" of {len(out)}" if isinstance(out, (tuple, list)) else "")
                raise PipelineError(f"stage {self.index} ({self.entry.class_name}).forward returned {got} but the manifest "
                                    f"lists {n} outputs ({', '.join(self.output_names)}): compile the model again.")
            out = tuple(out)
        if train:
            self._saved[microbatch] = _Saved(args, out)
        return out

    def _call(self, microbatch: int, args: list[Any], train: bool) -> Any:
        if train and self.offloader is not None and torch.is_grad_enabled():
            kept = [*self.module.parameters(), *self.module.buffers(),
                    *(a for a in torch.utils._pytree.tree_leaves(args) if isinstance(a, torch.Tensor))]
            with self.offloader.forward(microbatch, kept):
                return self._run(args, train)
        return self._run(args, train)

    def _run(self, args: list[Any], train: bool) -> Any:
        if train and self.recompute and torch.is_grad_enabled():
            return run_checkpointed(self.module, args, self.recompute)
        return self.module(*args)

    def loss(self, microbatch: int, output: Any, target: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
             scale: float, keep: bool = True) -> torch.Tensor:
        """`loss_fn(output, target) / scale` for the last stage; kept for backward (unless
        `keep` is false: evaluate), returned detached."""
        scaled = self.scaled_loss(output, target, loss_fn, scale)
        if keep:
            self._saved[microbatch].loss = scaled
        return scaled.detach()

    def scaled_loss(self, output: Any, target: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
                    scale: float) -> torch.Tensor:
        """`loss_fn(output, target) / scale` under the stage's precision, with its graph."""
        with autocast(self.precision, device_type(torch.utils._pytree.tree_leaves(output))):
            value = loss_fn(loss_input(output, self.precision), target)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            what = f"shape {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise PipelineError(f"loss_fn returned {what}, not a scalar tensor: reduce the loss over the batch (mean).")
        return value.reshape(()) / scale

    def forget(self, microbatch: int) -> None:
        """Drop what `forward` kept of one microbatch (an engine that keeps its own graph)."""
        self._saved.pop(microbatch, None)

    def backward(self, microbatch: int, grads: list[torch.Tensor | None] | None) -> list[torch.Tensor | None]:
        """Backward of one microbatch from its output gradients (None on the last stage);
        returns each input's gradient (None where the input needs none)."""
        saved = self._saved.pop(microbatch, None)
        self._release(microbatch)
        if saved is None:
            raise PipelineError(f"stage {self.index}: backward of microbatch {microbatch} before its forward "
                                f"(the schedule is wrong).")
        if self.is_last:
            if saved.loss is None:
                raise PipelineError(f"stage {self.index}: backward of microbatch {microbatch} without a loss.")
            if saved.loss.requires_grad:
                torch.autograd.backward(saved.loss)
        else:
            pairs = [(o, g) for o, g in zip(saved.outputs, grads or [])
                     if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return [a.grad if isinstance(a, torch.Tensor) and a.requires_grad else None for a in saved.args]

    def backward_input(self, microbatch: int, grads: list[torch.Tensor | None] | None) -> list[torch.Tensor | None]:
        """I: the input gradients of one microbatch, as `backward` returns them, leaving the
        weight gradients to `backward_weight` ([Note: split backward])."""
        saved = self._saved.get(microbatch)
        if saved is None or saved.roots is not None:
            raise PipelineError(f"stage {self.index}: I of microbatch {microbatch} "
                                f"{'before its forward' if saved is None else 'twice'} (the schedule is wrong).")
        if self.recompute == "selective":  # recomputes once only: I runs all of B ([Note: recomputation policies])
            whole = self.backward(microbatch, grads)
            self._saved[microbatch] = _Saved([], None, roots=[])  # W: nothing left to do
            return whole
        saved.roots, saved.root_grads = self._roots(microbatch, saved, grads)
        leaves = [a for a in saved.args if isinstance(a, torch.Tensor) and a.requires_grad]
        found: dict[int, torch.Tensor | None] = {}
        if saved.roots and leaves:
            params: list[torch.Tensor] = [p for p in self.module.parameters() if p.requires_grad]
            saved.seeds = None if self.recompute else split_backward.plan(saved.roots, leaves, params)
            if saved.seeds is not None:
                saved.seeds.hook()
            try:
                got = torch.autograd.grad(saved.roots, leaves, saved.root_grads or None, retain_graph=True,
                                          allow_unused=True)
            finally:
                if saved.seeds is not None:
                    saved.seeds.unhook()
            found = {id(leaf): g for leaf, g in zip(leaves, got)}
        if self.offloader is not None:
            self.offloader.evict(microbatch)  # brought back again ahead of W
        return [found.get(id(a)) if isinstance(a, torch.Tensor) else None for a in saved.args]

    def backward_weight(self, microbatch: int) -> None:
        """W: accumulate the weight gradients of one microbatch whose I has run, and free it."""
        saved = self._saved.get(microbatch)
        if saved is None or saved.roots is None:
            raise PipelineError(f"stage {self.index}: W of microbatch {microbatch} before its I (the schedule is wrong).")
        del self._saved[microbatch]
        self._release(microbatch)
        if saved.seeds is not None and saved.seeds.complete():
            saved.seeds.run()  # only the weights' own edges: [Note: weight-gradient seeds] in split_backward.py
            return
        params = [p for p in self.module.parameters() if p.requires_grad]
        if saved.roots and params:
            torch.autograd.backward(saved.roots, saved.root_grads or None,
                                    inputs=split_backward.weight_inputs(saved.roots, params))

    def _roots(self, microbatch: int, saved: _Saved,
               grads: list[torch.Tensor | None] | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """What backward starts from: the scaled loss (last stage; no gradient given) or
        the outputs that need a gradient, with theirs."""
        if self.is_last:
            if saved.loss is None:
                raise PipelineError(f"stage {self.index}: backward of microbatch {microbatch} without a loss.")
            return ([saved.loss] if saved.loss.requires_grad else []), []
        pairs = [(o, g) for o, g in zip(saved.outputs, grads or [])
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        return [o for o, _ in pairs], [g for _, g in pairs]

    def prefetch(self, microbatch: int) -> None:
        """Start bringing back what this microbatch's forward offloaded (ahead of its B or I)."""
        if self.offloader is not None:
            self.offloader.prefetch(microbatch)

    def _release(self, microbatch: int) -> None:
        """The offloader forgets a microbatch whose backward has begun: its handles live on in
        the autograd graph as long as that needs them."""
        if self.offloader is not None:
            self.offloader.release(microbatch)

    def clear(self) -> None:
        """Forget every microbatch in flight (after a failed step)."""
        self._saved.clear()
        if self.offloader is not None:
            self.offloader.clear()
