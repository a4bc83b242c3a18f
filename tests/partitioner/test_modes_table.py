"""The table of mode-dependent ops ([Note: modes in generated code] in partitioner/trace/modes.py):
each op's mode argument is written as the stage's mode, only where the trace saw its train-mode
value; an op that fixed its mode in its identity is refused; the compile's note on dropout."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
import torch.fx
import torch.nn.functional as F

from partitioner.errors import TraceError
from partitioner.trace.modes import MODE_ARGS, ModeValue, check_modes, note_dropout, with_mode
from partitioner.trace.trace import trace

aten = torch.ops.aten


def _names(target: Any) -> list[str] | None:
    """The argument names of an aten op's schema or a Python function's signature."""
    if isinstance(target, torch._ops.OpOverload):
        return [a.name for a in target._schema.arguments]
    try:
        return list(inspect.signature(target).parameters)
    except (TypeError, ValueError):  # a builtin: torch.dropout, F.scaled_dot_product_attention
        return None


def test_each_position_is_its_signature_s() -> None:
    for target, where in MODE_ARGS.items():
        names = _names(target)
        if names is None:
            continue
        assert names[where.index] == where.name, target
        for pos, name in filter(None, (where.stats, where.rate)):
            assert names[pos] == name, target


@pytest.mark.parametrize(("target", "args", "kwargs", "written"), [
    (aten.scaled_dot_product_attention.default, (1, 2, 3, None, 0.1), {}, "(0.1 if self.training else 0.0)"),
    (F.scaled_dot_product_attention, (1, 2, 3), {"dropout_p": 0.1}, "(0.1 if self.training else 0.0)"),
    (aten._scaled_dot_product_efficient_attention.default, (1, 2, 3, None, False, 0.2), {},
     "(0.2 if self.training else 0.0)"),
    (aten.native_dropout.default, (1, 0.1, True), {}, "self.training"),
    (aten.lstm.input, (1, [], [], True, 2, 0.3, True, False, True), {}, "self.training"),
    (aten.gru.data, (1, 2, 3, [], True, 2, 0.3, True, False), {}, "self.training"),
    (aten.instance_norm.default, (1, None, None, 4, 5, True, 0.1, 1e-5, False), {}, "self.training"),
    (aten._native_batch_norm_legit.default, (1, None, None, 4, 5, True, 0.1, 1e-5), {}, "self.training"),
    (F.rrelu, (1,), {"lower": 0.1, "upper": 0.3, "training": True}, "self.training"),
    (aten.rrelu_with_noise.default, (1, 2, 0.1, 0.3, True), {}, "self.training"),
])
def test_a_train_mode_value_is_written_as_the_mode(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                                                   written: str) -> None:
    new_args, new_kwargs = with_mode(target, args, kwargs)
    modes = [v for v in (*new_args, *new_kwargs.values()) if isinstance(v, ModeValue)]
    assert [repr(v) for v in modes] == [written]


@pytest.mark.parametrize(("target", "args", "kwargs"), [
    (aten.scaled_dot_product_attention.default, (1, 2, 3, None, 0.0), {}),  # no dropout in either mode
    (F.dropout, (1,), {"p": 0.5, "training": False}),  # the model fixed it off
    (F.dropout, (1, 0.5), {}),  # left out: F.dropout's default, on in both modes
    (aten.batch_norm.default, (1, None, None, None, None, True, 0.1, 1e-5, False), {}),  # no running statistics
    (aten.instance_norm.default, (1, None, None, None, None, True, 0.1, 1e-5, False), {}),
    (aten.add_.Tensor, (1, 1), {}),  # not a counter
])
def test_a_value_fixed_by_the_model_stays_a_constant(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    assert with_mode(target, args, kwargs) == (args, kwargs)


def test_an_always_updating_batch_norm_is_refused() -> None:
    graph = torch.fx.Graph()
    x, mean, var = graph.placeholder("x"), graph.placeholder("mean"), graph.placeholder("var")
    graph.output(graph.call_function(aten._native_batch_norm_legit_functional.default,
                                     (x, None, None, mean, var, True, 0.1, 1e-5)))
    with pytest.raises(TraceError, match=r"_native_batch_norm_legit_functional.*pipe.eval\(\).*F.batch_norm"):
        check_modes(torch.fx.GraphModule(torch.nn.Module(), graph))


class _Drop(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.drop = torch.nn.Dropout(0.1)
        self.rnn = torch.nn.GRU(4, 4, num_layers=2, dropout=0.2, batch_first=True)
        self.none = torch.nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.none(self.rnn(self.drop(self.fc(x)))[0])


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_the_compile_notes_the_dropouts_once(tracer: str) -> None:
    """fx keeps the GRU whole (its dropout is the module's); export records aten.gru.input."""
    traced = trace(_Drop(), (torch.randn(2, 3, 4),), {}, tracer=tracer)
    lines: list[str] = []
    line = note_dropout(traced.gm, lines.append)
    assert lines == [line] and line is not None
    assert line.startswith("note: 2 module(s) with dropout (drop, rnn) follow pipe.train() / pipe.eval()")
    assert "in distribution, not in values" in line
    assert note_dropout(trace(torch.nn.Linear(4, 4), (torch.randn(2, 4),), {}).gm, lines.append) is None
