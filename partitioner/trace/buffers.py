"""Buffers a model changes as it runs (BatchNorm's running statistics and counter).

- `BufferSnapshot`, `kept_buffers`: compiling runs the model (tracing checks, shape propagation, profiling),
  which would move a train-mode BatchNorm's running statistics; the user's module gets its
  buffers back as they were, so the package's buffers are the model's.
- `batch_statistics_warning`: a train-mode BatchNorm normalises each microbatch by that
  microbatch's own mean and variance, which differ from the whole batch's; with more than
  one microbatch the partitioned model would train differently from the original, so the
  compile says so, naming the modules and the fixes.
- `warn_state_updates`: any other parameter or buffer the forward writes in place (a
  momentum teacher, spectral norm's power iteration, a counter) is written once per call,
  so once per microbatch where the original writes it once per batch; the compile says so.
- `warn_train_only_updates`: such an update the model makes in train mode only (spectral
  norm's power iteration, behind a branch on `self.training`) is traced on its train-mode
  side, so the stages make it after `pipe.eval()` too; the compile says so.
- `mutated_buffers`: the nodes that touch each buffer the forward writes in place, which
  the solver keeps on one stage.

[Note: a mutated buffer lives on one stage]
    Every stage that reads a buffer holds its own copy (codegen/layout.py), and a write
    changes only the copy of the stage that makes it.  So a buffer the forward writes in
    place (`self.steps += 1`, which export records as `add_` and a `copy_` at the end of
    the graph; `self.steps.add_(1)`) must have all of its readers and writers on one
    stage: a reader elsewhere would see its own stale copy, or, where it received the
    value instead, the value after the whole stage ran rather than at its place in the
    graph.  `mutated_buffers` names, for each node, the written buffers it reads or
    writes, directly or through an alias (a view, an in-place op's result:
    `node.meta["aliases"]` and `["writes"]`, recorded by passes.propagate); the
    coarsener (solve/coarsen.py) brings each buffer's nodes together in its topological
    order and keeps them in one block, so any plan, the DP's or CP-SAT's, puts them on
    one stage.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from typing import Any, Callable, Iterator

import torch
import torch.fx

from .state import written_by

from .passes import node_module

__all__ = ["BatchStatisticsWarning", "BufferSnapshot", "StateUpdateWarning", "batch_statistics_modules", "kept_buffers",
           "mutated_buffers", "updated_state", "warn_batch_statistics", "warn_state_updates", "TrainOnlyUpdateWarning",
           "warn_train_only_updates"]


class BatchStatisticsWarning(UserWarning):
    """A train-mode BatchNorm in a model compiled for more than one microbatch."""


class StateUpdateWarning(UserWarning):
    """A forward that updates parameters or buffers in place, compiled for more than one microbatch."""


class TrainOnlyUpdateWarning(UserWarning):
    """A forward that updates state in place in train mode only, which the stages update in eval mode too."""


class BufferSnapshot:
    """Every buffer of a module as it is now; `restore()` puts them back."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.saved = [(b, b.detach().clone()) for b in module.buffers() if not b.is_meta]

    def restore(self) -> None:
        with torch.no_grad():
            for buffer, value in self.saved:
                buffer.copy_(value)


@contextlib.contextmanager
def kept_buffers(module: torch.nn.Module) -> Iterator[None]:
    """Run the body, then put every buffer of `module` back to its value before it."""
    snapshot = BufferSnapshot(module)
    try:
        yield
    finally:
        snapshot.restore()


def mutated_buffers(gm: torch.fx.GraphModule) -> dict[str, tuple[str, ...]]:
    """For each call node that reads or writes a buffer the forward writes in place, directly
    or through an alias, those buffers' names ([Note: a mutated buffer lives on one stage])."""
    roots, order = _written_attributes(gm)
    written = set(order)
    found: dict[str, tuple[str, ...]] = {}
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            touched = {r for a in node.all_input_nodes for r in roots[a.name]} & written
            if touched:
                found[node.name] = tuple(sorted(touched))
    return found


def _written_attributes(gm: torch.fx.GraphModule) -> tuple[dict[str, set[str]], list[str]]:
    """For each node, the attributes (parameters, buffers, constants) its value aliases; and
    the attributes some node writes in place, directly or through an alias (graph order)."""
    roots: dict[str, set[str]] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            roots[node.name] = {str(node.target)}
        else:
            roots[node.name] = {r for name in node.meta.get("aliases", ()) for r in roots.get(name, ())}
    written = {r: None for node in gm.graph.nodes for name in node.meta.get("writes", ()) for r in sorted(roots[name])}
    return roots, list(written)


def batch_statistics_modules(gm: torch.fx.GraphModule) -> list[str]:
    """The modules (dotted paths, graph order) whose batch norm uses the batch's statistics."""
    found: list[str] = []
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method") and _batch_statistics(node):
            module = node_module(node) or node.name
            if module not in found:
                found.append(module)
    return found


def warn_batch_statistics(gm: torch.fx.GraphModule, microbatches: int, say: Callable[[str], None] | None = None) -> str | None:
    """When a train-mode batch norm meets several microbatches: `say("warning: ...")`, or
    without `say` a `BatchStatisticsWarning`; the message, or None."""
    modules = batch_statistics_modules(gm)
    if microbatches <= 1 or not modules:
        return None
    message = (
        f"{len(modules)} BatchNorm module(s) in train mode ({_shown(modules)}) normalise each of the {microbatches} "
        f"microbatches by its own mean and variance, and update their running statistics once per "
        f"microbatch: training will differ from the original model's on the whole batch. Compile with "
        f"--microbatches 1, or replace BatchNorm with GroupNorm or LayerNorm (statistics per sample), or "
        f"call model.eval() on the BatchNorm modules in build_model() to use the running statistics."
    )
    return _warn(message, BatchStatisticsWarning, say)


def updated_state(gm: torch.fx.GraphModule) -> list[str]:
    """The parameters and buffers (graph order) the forward writes in place, a train-mode
    batch norm's running statistics and counter left out (`warn_batch_statistics` says those)."""
    norms = set(batch_statistics_modules(gm))
    return [name for name in _written_attributes(gm)[1] if name.rpartition(".")[0] not in norms]


def warn_state_updates(gm: torch.fx.GraphModule, microbatches: int, say: Callable[[str], None] | None = None) -> str | None:
    """When the forward updates state in place (a momentum teacher's weights, spectral norm's
    power iteration, a counter) and there are several microbatches: `say("warning: ...")`,
    or without `say` a `StateUpdateWarning`; the message, or None.  The stages run the
    update as the forward does, once per call: once per microbatch."""
    names = updated_state(gm)
    if microbatches <= 1 or not names:
        return None
    message = (
        f"forward() updates {len(names)} parameter(s) or buffer(s) in place on every call ({_shown(names)}), as a "
        f"momentum teacher, spectral norm's power iteration or a counter does: with {microbatches} microbatches "
        f"the update runs once per microbatch, {microbatches} times per batch where the original model runs it "
        f"once, so training will differ from the original model's. Compile with --microbatches 1, or make the "
        f"update once per step outside forward() (after optimizer.step() in the training loop)."
    )
    return _warn(message, StateUpdateWarning, say)


def warn_train_only_updates(gm: torch.fx.GraphModule, model: torch.nn.Module, args: tuple[Any, ...],
                            kwargs: dict[str, Any], say: Callable[[str], None] | None = None) -> str | None:
    """When state the traced (train-mode) forward updates in place is not written by the
    model's own eval-mode forward on `args, kwargs` (a Python branch on `self.training`,
    which the trace took on its train side): `say("warning: ...")`, or without `say` a
    `TrainOnlyUpdateWarning`; the message, or None.  The model's state is put back."""
    updated = updated_state(gm)
    if not updated or any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        return None
    was_training = model.training
    try:
        with torch.no_grad():
            in_eval = set(written_by(model.eval(), lambda: model(*args, **kwargs)))
    finally:
        model.train(was_training)
    still = [name for name in updated if name not in in_eval]
    if not still:
        return None
    message = (
        f"forward() updates {_shown(still)} in place in train mode only (a branch on self.training, as spectral "
        f"norm's power iteration is): the stages follow the train-mode trace, so after pipe.eval() they still "
        f"update it and compute with the updated values, where model.eval() leaves it as it is. Training is "
        f"exact; evaluate such a model with its original module (load the pipeline's state_dict into it)."
    )
    return _warn(message, TrainOnlyUpdateWarning, say)


def _shown(names: list[str]) -> str:
    """The first six names, and how many more."""
    return ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")


def _warn(message: str, category: type[Warning], say: Callable[[str], None] | None) -> str:
    """`say("warning: ...")`, or without `say` a warning of `category` at the caller's caller."""
    if say is None:
        warnings.warn(message, category, stacklevel=4)
    else:
        say(f"warning: {message}")
    return message


def _batch_statistics(node: torch.fx.Node) -> bool:
    """Whether a call node is a batch norm with `training=True` (any tracer's spelling)."""
    target: Any = node.target
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    if "batch_norm" not in name:
        return False
    if "with_update" in name or "functional" in name:  # these always use the batch's statistics
        return True
    if "no_training" in name or "no_update" in name:
        return False
    return bool(_argument(node, "training"))


def _argument(node: torch.fx.Node, name: str) -> Any:
    """The value of argument `name` of a call node, by keyword or by its position."""
    if name in node.kwargs:
        return node.kwargs[name]
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        names = [a.name for a in schema.arguments]
    else:
        try:
            names = list(inspect.signature(node.target).parameters)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return None
    if name in names and names.index(name) < len(node.args):
        return node.args[names.index(name)]
    return None
