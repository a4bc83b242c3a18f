"""The stage-source emitter writes each node as the call a person would write."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx

from codegen.source import EmitError, StageSource, attr_name, format_value, shape_comment


@pytest.mark.parametrize(
    "value, text",
    [
        (3, "3"), (1.5, "1.5"), (float("inf"), "float('inf')"), (float("-inf"), "float('-inf')"),
        (None, "None"), ((1,), "(1,)"), ([1, 2], "[1, 2]"), ({"a": 1}, "{'a': 1}"),
        (torch.float16, "torch.float16"), (torch.device("cpu"), "torch.device('cpu')"),
        (torch.contiguous_format, "torch.contiguous_format"), (..., "..."),
        (slice(None, 4, None), "slice(None, 4, None)"),
    ],
)
def test_format_value(value: object, text: str) -> None:
    assert format_value(value, {}) == text


def test_format_value_rejects_unknown_constants() -> None:
    with pytest.raises(EmitError, match="cannot write a constant of type object"):
        format_value(object(), {})


@pytest.mark.parametrize(
    "source, name",
    [("h.0.attn.c_attn.weight", "h_0_attn_c_attn_weight"), ("_tensor_constant0", "tensor_constant0"), ("0.weight", "p_0_weight")],
)
def test_attr_name(source: str, name: str) -> None:
    assert attr_name(source) == name


def _statement(fn: object, *args: object) -> str:
    graph = torch.fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    subst = {"X": x, "Y": y}
    real = torch.fx.node.map_aggregate(args, lambda a: subst.get(a, a) if isinstance(a, str) else a)
    node = graph.call_function(fn, real)  # type: ignore[arg-type]
    node.name = "out"
    names = {x: "x", y: "y", node: "out"}
    return StageSource(imports=set()).statement(node, names)


def test_statements_read_like_python() -> None:
    assert _statement(operator.add, "X", "Y") == "out = x + y"
    assert _statement(operator.matmul, "X", "Y") == "out = x @ y"
    assert _statement(operator.neg, "X") == "out = -x"
    assert _statement(operator.getitem, "X", (slice(None), -1)) == "out = x[:, -1]"
    assert _statement(operator.getitem, "X", (Ellipsis, slice(0, 4, 2))) == "out = x[..., 0:4:2]"
    assert _statement(torch.nn.functional.gelu, "X") == "out = F.gelu(x)"
    assert _statement(torch.cat, ["X", "Y"], 1) == "out = torch.cat([x, y], 1)"
    assert _statement(torch.ops.aten.addmm.default, "X", "Y", "X") == "out = aten.addmm.default(x, y, x)"


def test_shape_comments_write_the_dimension_that_follows_the_batch_as_batch() -> None:
    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    node.meta["tensor_meta"] = torch.fx.passes.shape_prop._extract_tensor_metadata(torch.zeros(48, 32))
    assert shape_comment(node, "batch") == "  # (48, 32)"  # no free dimension recorded: the compiled sizes
    node.meta["batch_dim"] = (0, 8)
    assert shape_comment(node, "batch") == "  # (8 * batch, 32)"
    assert shape_comment(node, "") == "  # (48, 32)"  # a stage that does not read its rows
    node.meta["batch_dim"] = (1, 1)
    assert shape_comment(node, "rows") == "  # (48, rows)"
