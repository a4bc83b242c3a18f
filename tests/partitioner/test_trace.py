"""Tracing: fx through every module, export as the fallback, specialisation to a microbatch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from partitioner.errors import TraceError
from partitioner.trace.passes import propagate, specialize
from partitioner.trace.trace import trace


class WithDefault(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> dict[str, Any]:
        h = self.fc(x)
        if mask is not None:  # fx would take this branch with a proxy; the default fixes it
            h = h * mask
        return {"h": h, "both": (h, x.view(x.size(0), -1))}


class UsesLen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * len(x)


def test_fx_traces_through_modules_with_defaults_fixed() -> None:
    x = torch.randn(3, 4)
    t = trace(WithDefault(), (x,), {})
    assert t.tracer == "fx"
    assert [k for _, k in t.input_keys] == [0]
    ops = {n.op for n in t.gm.graph.nodes}
    assert "call_module" not in ops
    assert {str(n.target) for n in t.gm.graph.nodes if n.op == "get_attr"} == {"fc.weight", "fc.bias"}
    assert not any("mul" in str(n.target) for n in t.gm.graph.nodes)
    assert t.out_spec.type is dict and t.out_spec.context == ["h", "both"]


def test_export_is_the_fallback_when_fx_fails() -> None:
    x = torch.randn(3, 4)
    t = trace(UsesLen(), (x,), {})
    assert t.tracer == "export"
    with pytest.raises(TraceError, match="could not trace the model. Tried fx: RuntimeError: 'len' is not supported"):
        trace(UsesLen(), (x,), {}, tracer="fx")


def test_unknown_tracer() -> None:
    with pytest.raises(TraceError, match="unknown --tracer 'jit'"):
        trace(UsesLen(), (torch.randn(2, 4),), {}, tracer="jit")


def test_specialize_folds_sizes_into_constants() -> None:
    x = torch.randn(3, 4)
    t = trace(WithDefault(), (x,), {})
    values = propagate(t.gm, [x])
    specialize(t.gm, values)
    for node in t.gm.graph.nodes:
        if node.op in ("call_function", "call_method"):
            assert "tensor_meta" in node.meta, f"{node.format_node()} is not a tensor"
    view = next(n for n in t.gm.graph.nodes if n.target == "view")
    assert view.args[1:] == (3, -1)
    torch.testing.assert_close(t.gm(x)["h"], F.linear(x, t.gm.fc.weight, t.gm.fc.bias))
