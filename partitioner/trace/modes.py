"""The operations whose behaviour depends on the module's mode (`model.train()` /
`model.eval()`), in both tracers' spellings, and how the generated stages follow it.

- `MODE_ARGS`: the one table: each op, its argument that carries the mode, and the
  argument that holds its dropout rate where it has one.
- `with_mode`: a call's arguments with the mode argument written as the stage's mode
  (`ModeValue`), which codegen/source.py writes as `self.training`.
- `check_modes`: refuses, at compile time, an op that fixed its mode in a way no argument
  can undo.
- `note_dropout`: the one line the compile says about a model's dropouts.

[Note: modes in generated code]
    A trace runs the model in train mode (partitioner/trace/trace.py), so every argument
    that says "training or not" holds its train-mode value: `training=True`, a dropout
    rate `p = 0.1` where the model wrote `p if self.training else 0.0` (Hugging Face's and
    nn.MultiheadAttention's SDPA), `use_input_stats=True`.  The stages must follow
    `pipe.train()` / `pipe.eval()` as the original follows `model.train()`, so each of
    those arguments is written as an expression of the stage module's `self.training`:
    a flag as `self.training`, a rate as `(0.1 if self.training else 0.0)`.  The rules:
    - only the train-mode value is rewritten: a flag the trace saw False, or a rate of
      0, was fixed by the model itself (`F.dropout(x, p, training=False)`, a frozen
      batch norm) and stays a constant;
    - a norm's `training` / `use_input_stats` follows the mode only where the call has
      running statistics: without them (`track_running_stats=False`) the module uses
      the batch's statistics in both modes;
    - the counter BatchNorm bumps only in train mode (`num_batches_tracked.add_(1)`,
      which export records as an unconditional `add_`) adds `(1 if self.training else 0)`;
    - an op that fixed its mode in its identity rather than an argument (batch norm
      traced as `_batch_norm_with_update` or `_native_batch_norm_legit_functional`,
      which always update the running statistics) is refused at compile time
      (`check_modes`), never written wrong.
    In eval mode a stage then computes what the original computes in eval mode, to
    float32 rounding.  In train mode a dropout draws its masks from the stage's own
    seeded stream ([Note: dropout streams] in runtime/modes.py): the pipeline's outputs
    equal the original's in distribution, not in values (`note_dropout` says so).
    A module the compiler keeps whole (partitioner/trace/kept.py) is a submodule of its
    stage, so `pipe.eval()` reaches it as `model.eval()` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
import torch.fx
import torch.nn.functional as F

from ..errors import TraceError
from .kept import KeptModule
from .passes import node_module

__all__ = ["DROPOUTS", "MODE_ARGS", "ModeArg", "ModeValue", "check_modes", "draws_a_mask", "dropout_modules", "note_dropout",
           "with_mode"]


@dataclass(frozen=True)
class ModeValue:
    """An argument that follows the stage's mode: `train` in train mode, `eval` in eval mode."""

    train: Any
    eval: Any

    def __repr__(self) -> str:
        if self.train is True and self.eval is False:
            return "self.training"
        return f"({self.train!r} if self.training else {self.eval!r})"


@dataclass(frozen=True)
class ModeArg:
    """Where an op carries its mode: argument `name` at `index` (0-based, its signature's),
    a `flag` (training: True / False) or a `rate` (dropout probability: p / 0.0);
    `stats`, the position of its running mean, for a norm that follows the mode only when
    it has one; `rate`, the position of its dropout probability, for a dropout."""

    index: int
    name: str
    kind: Literal["flag", "rate"] = "flag"
    stats: tuple[int, str] | None = None
    rate: tuple[int, str] | None = None


_aten = torch.ops.aten


def _schema(op: Any, name: str, stats: str | None = None, rate: str | None = None) -> ModeArg:
    """The `ModeArg` of an aten overload, its positions read from the op's schema."""
    names = [a.name for a in op._schema.arguments]
    kind: Literal["flag", "rate"] = "rate" if name == "dropout_p" else "flag"
    return ModeArg(names.index(name), name, kind, (names.index(stats), stats) if stats else None,
                   (names.index(rate), rate) if rate else None)


def _aten_table() -> dict[Any, ModeArg]:
    """torch.export's spellings (aten overloads) of the mode-dependent ops."""
    table: dict[Any, ModeArg] = {}
    for op in (_aten.dropout.default, _aten.dropout_.default, _aten.feature_dropout.default,
               _aten.feature_dropout_.default, _aten.alpha_dropout.default, _aten.alpha_dropout_.default,
               _aten.feature_alpha_dropout.default, _aten.feature_alpha_dropout_.default):
        table[op] = _schema(op, "train", rate="p")
    table[_aten.native_dropout.default] = _schema(_aten.native_dropout.default, "train", rate="p")
    for packet in (_aten.lstm, _aten.gru, _aten.rnn_tanh, _aten.rnn_relu):
        for op in (packet.input, packet.data):
            table[op] = _schema(op, "train", rate="dropout")
    for op in (_aten.batch_norm.default, _aten.native_batch_norm.default, _aten._native_batch_norm_legit.default,
               _aten.cudnn_batch_norm.default, _aten.miopen_batch_norm.default, _aten._batch_norm_impl_index.default):
        table[op] = _schema(op, "training", stats="running_mean")
    table[_aten.instance_norm.default] = _schema(_aten.instance_norm.default, "use_input_stats", stats="running_mean")
    table[_aten.rrelu.default] = _schema(_aten.rrelu.default, "training")
    table[_aten.rrelu_with_noise.default] = _schema(_aten.rrelu_with_noise.default, "training")
    for op in (_aten.scaled_dot_product_attention.default, _aten._scaled_dot_product_attention_math.default,
               _aten._scaled_dot_product_flash_attention.default,
               _aten._scaled_dot_product_flash_attention_for_cpu.default,
               _aten._scaled_dot_product_efficient_attention.default,
               _aten._scaled_dot_product_cudnn_attention.default):
        table[op] = _schema(op, "dropout_p", rate="dropout_p")
    return table


_P, _MEAN_F, _MEAN = (1, "p"), (1, "running_mean"), (3, "running_mean")

#: op -> where it carries its mode ([Note: modes in generated code]); torch.fx's spellings
#: (torch.nn.functional, torch.*) first, positions from their signatures, then aten's
MODE_ARGS: dict[Any, ModeArg] = {
    F.dropout: ModeArg(2, "training", rate=_P), F.dropout1d: ModeArg(2, "training", rate=_P),
    F.dropout2d: ModeArg(2, "training", rate=_P), F.dropout3d: ModeArg(2, "training", rate=_P),
    F.alpha_dropout: ModeArg(2, "training", rate=_P), F.feature_alpha_dropout: ModeArg(2, "training", rate=_P),
    torch.dropout: ModeArg(2, "train", rate=_P), torch.feature_dropout: ModeArg(2, "train", rate=_P),
    torch.alpha_dropout: ModeArg(2, "train", rate=_P), torch.feature_alpha_dropout: ModeArg(2, "train", rate=_P),
    F.scaled_dot_product_attention: ModeArg(4, "dropout_p", "rate", rate=(4, "dropout_p")),
    F.multi_head_attention_forward: ModeArg(13, "training", rate=(10, "dropout_p")),
    F.batch_norm: ModeArg(5, "training", stats=_MEAN_F), torch.batch_norm: ModeArg(5, "training", stats=_MEAN),
    F.instance_norm: ModeArg(5, "use_input_stats", stats=_MEAN_F), torch.instance_norm: ModeArg(5, "use_input_stats", stats=_MEAN),
    F.rrelu: ModeArg(3, "training"),
    **_aten_table(),
}

#: the ops that draw a random mask (dropout in its forms, SDPA's, RNNs' between layers)
DROPOUTS: frozenset[Any] = frozenset(t for t, a in MODE_ARGS.items() if a.rate is not None)

#: ops whose identity fixes the mode: they always update running statistics -> the fix
_FIXED: dict[Any, str] = {
    _aten._batch_norm_with_update.default: "aten.batch_norm",
    _aten._batch_norm_with_update_functional.default: "aten.batch_norm",
    _aten._native_batch_norm_legit_functional.default: "aten._native_batch_norm_legit",
}


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str) -> Any:
    """A call's argument by its position or its keyword name (None when left out)."""
    return args[index] if len(args) > index else kwargs.get(name)


def _mode_value(where: ModeArg, value: Any, stats: Any) -> Any:
    """The mode argument as written: a `ModeValue` for its train-mode value, else `value`."""
    if where.stats is not None and stats is None:  # no running statistics: the batch's in both modes
        return value
    if where.kind == "rate":
        return ModeValue(value, 0.0) if isinstance(value, (int, float)) and value != 0 else value
    return ModeValue(True, False) if value is True else value


def with_mode(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """`args`, `kwargs` of a call with its mode argument following the stage's mode
    ([Note: modes in generated code]); unchanged for an op that has none."""
    if _is_counter(target, args):
        return (args[0], ModeValue(args[1], 0), *args[2:]), kwargs
    where = _lookup(target)
    if where is None:
        return args, kwargs
    stats = None if where.stats is None else _argument(args, kwargs, *where.stats)
    if len(args) > where.index:
        value = _mode_value(where, args[where.index], stats)
        return (*args[:where.index], value, *args[where.index + 1:]), kwargs
    if where.name in kwargs:  # left out, the op's default holds in every mode: the model fixed it
        return args, {**kwargs, where.name: _mode_value(where, kwargs[where.name], stats)}
    return args, kwargs


def _lookup(target: Any) -> ModeArg | None:
    try:
        return MODE_ARGS.get(target)
    except TypeError:  # an unhashable callable
        return None


def _is_counter(target: Any, args: tuple[Any, ...]) -> bool:
    """Whether a call is BatchNorm's `num_batches_tracked.add_(1)` as export records it."""
    return (target is _aten.add_.Tensor and len(args) >= 2 and isinstance(args[0], torch.fx.Node)
            and args[0].op == "get_attr" and str(args[0].target).rsplit(".", 1)[-1] == "num_batches_tracked"
            and isinstance(args[1], (int, float)))


def check_modes(gm: torch.fx.GraphModule) -> None:
    """Refuse an op whose mode the trace fixed in a way the stages cannot follow
    ([Note: modes in generated code])."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.target in _FIXED:
            where = node_module(node) or node.name
            raise TraceError(
                f"{where} was traced as aten.{node.target.__name__}, which updates the running statistics "
                f"in every mode, while the original model's batch norm uses them unchanged after "
                f"model.eval(): the pipeline could not follow pipe.eval(). Call the batch norm as "
                f"torch.nn.BatchNorm*d or F.batch_norm(..., training=self.training) (traced as "
                f"{_FIXED[node.target]}, whose mode the stages follow), or compile with --tracer fx.")


def draws_a_mask(node: torch.fx.Node) -> bool:
    """Whether a call node is a dropout (of `DROPOUTS`) with a rate above 0: left out, the
    rate of a dropout function is its default 0.5, SDPA's its default 0."""
    where = _lookup(node.target) if node.op == "call_function" else None
    if where is None or where.rate is None:
        return False
    rate = _argument(node.args, dict(node.kwargs), *where.rate)
    return (rate is None and where.kind == "flag") or (isinstance(rate, (int, float)) and rate > 0)


def dropout_modules(gm: torch.fx.GraphModule) -> list[str]:
    """The modules (dotted paths, graph order) whose dropout draws a mask in train mode only."""
    found: list[str] = []
    for node in gm.graph.nodes:
        if (draws_a_mask(node) and _follows_mode(node)) or _kept_dropout(node):
            module = node_module(node) or node.name
            if module not in found:
                found.append(module)
    return found


def _kept_dropout(node: torch.fx.Node) -> bool:
    """Whether a node calls a module kept whole that holds a dropout above 0 (`nn.Dropout` and
    its kin, an RNN's between layers, nn.MultiheadAttention's)."""
    if node.op != "call_function" or not isinstance(node.target, KeptModule):
        return False
    return any(_dropout_rate(m) > 0 for m in node.target.module.modules())


def _dropout_rate(module: torch.nn.Module) -> float:
    """A module's own dropout probability (0 for a module without dropout)."""
    if isinstance(module, torch.nn.modules.dropout._DropoutNd):
        return float(module.p)
    if isinstance(module, (torch.nn.RNNBase, torch.nn.MultiheadAttention)):
        return float(module.dropout)
    return 0.0


def _follows_mode(node: torch.fx.Node) -> bool:
    """Whether `with_mode` writes a node's mode argument as the stage's mode."""
    args, kwargs = with_mode(node.target, node.args, dict(node.kwargs))
    return any(isinstance(v, ModeValue) for v in (*args, *kwargs.values()))


def note_dropout(gm: torch.fx.GraphModule, say: Callable[[str], None] | None) -> str | None:
    """`say("note: ...")`, once, when the model has a dropout that draws a mask; the line, or None."""
    modules = dropout_modules(gm)
    if not modules:
        return None
    shown = ", ".join(modules[:6]) + (f" and {len(modules) - 6} more" if len(modules) > 6 else "")
    line = (f"note: {len(modules)} module(s) with dropout ({shown}) follow pipe.train() / pipe.eval(); in train "
            f"mode each microbatch draws its own masks, so outputs and losses equal the original model's in "
            f"distribution, not in values (after pipe.eval() they equal model.eval()'s).")
    if say is not None:
        say(line)
    return line
