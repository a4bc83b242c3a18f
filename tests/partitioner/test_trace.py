"""Tracing: fx through every module, export as the fallback, specialisation to a microbatch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree

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
    out = pytree.tree_unflatten(t.gm(x), t.out_spec)  # the graph returns the output's leaves
    torch.testing.assert_close(out["h"], F.linear(x, t.gm.fc.weight, t.gm.fc.bias))


class Repeated(nn.Module):
    """Blocks that repeat, with what a repeat must not be served for: views, an in-place
    add on an op's result, an op that writes its input (an embedding's max_norm renormalises
    the rows it reads) and a tuple result."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"ln": nn.LayerNorm(8), "fc": nn.Linear(8, 8), "bn": nn.BatchNorm1d(8),
                                                   "emb": nn.Embedding(10, 8, max_norm=1.0)})
                                    for _ in range(3))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            h = b["fc"](F.gelu(b["ln"](x))) + b["emb"](ids)
            h += x
            halves = h.split(4, dim=-1)
            top = torch.max(torch.cat([halves[1], halves[0]], -1).transpose(0, 1), dim=1)[0]
            x = b["bn"](h) + top.view(1, -1)
        return x


def _meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return type(value), value.shape, value.stride(), value.dtype, value.requires_grad, value.is_leaf
    return tuple(map(_meta, value)) if isinstance(value, (tuple, list)) else value


@pytest.mark.parametrize("fake", [False, True], ids=["meta", "fake-cpu-bf16"])
def test_repeated_meta_ops_give_what_running_them_gives(fake: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from partitioner.trace import passes
    from partitioner.trace.fake import on_fake_cpu
    from runtime.precision import autocast

    with torch.device("meta"):
        model = Repeated()
    t = trace(model, (torch.empty(4, 8, device="meta"), torch.zeros(4, dtype=torch.long, device="meta")), {},
              tracer="fx")  # fx keeps F.embedding one call, which writes its weight

    def run() -> tuple[list[Any], list[Any]]:
        x = [torch.empty(4, 8, device="meta"), torch.zeros(4, dtype=torch.long, device="meta")]
        if fake:
            with on_fake_cpu(t.gm, x) as inputs, autocast("bf16", "cpu"):
                values = propagate(t.gm, inputs)
        else:
            values = propagate(t.gm, x)
        return ([_meta(v) for v in values.values()],
                [(n.meta.get("writes"), n.meta.get("aliases"), n.meta.get("tensor_meta")) for n in t.gm.graph.nodes])

    served: list[Any] = []
    call = passes._Repeats.call

    def counted(self: Any, run: Any, target: Any, args: Any, kwargs: Any) -> Any:
        served.append(passes._signature(target, args, kwargs) in self.first)
        return call(self, run, target, args, kwargs)

    monkeypatch.setattr(passes._Repeats, "call", counted)
    repeated = run()
    assert sum(served) >= 2 * 4  # the second and third blocks' layer_norm, gelu, linear, cat, max, ...
    monkeypatch.setattr(passes._Repeats, "call", lambda self, run, target, args, kwargs: run(target, args, kwargs))
    assert repeated == run()
    assert {"embedding", "embedding_1", "embedding_2"} <= {n.name for n in t.gm.graph.nodes if n.meta.get("writes")}


def test_a_repeat_is_a_copy_of_the_first_result() -> None:
    from partitioner.trace.passes import _Repeats

    ran: list[Any] = []

    def run(target: Any, args: Any, kwargs: Any) -> Any:
        ran.append(target)
        return getattr(args[0], target)(*args[1:], **kwargs) if isinstance(target, str) else target(*args, **kwargs)

    repeats = _Repeats()
    x = torch.empty(2, 3, device="meta", requires_grad=True)
    with torch.enable_grad():
        first, again = (repeats.call(run, torch.mul, (x, 2.0), {}) for _ in range(2))
        other = repeats.call(run, torch.mul, (x, 2), {})  # an int scalar: another signature
        views = [repeats.call(run, "t", (x,), {}) for _ in range(2)]
        cpu = [repeats.call(run, torch.mul, (torch.ones(2), 2.0), {}) for _ in range(2)]
    assert len(ran) == 6  # the repeat of mul alone was served
    assert _meta(first) == _meta(again) and not again.is_leaf and again.requires_grad
    assert again.untyped_storage()._cdata != first.untyped_storage()._cdata
    assert other.dtype == first.dtype and views[1]._base is x and cpu[1].sum().item() == 4.0


class NoGradRegion(nn.Module):
    """A `torch.no_grad()` region that reads a parameter, computes from the input and from an
    item of a tuple made with gradients, writes a buffer with `out=`, and whose result is
    added to the path with gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("scale", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        pair = torch.var_mean(h, dim=0)
        with torch.no_grad():
            torch.mul(self.fc.weight.sum(0), 0.5, out=self.scale)
            stopped = h * 2 + x * pair[0]
        return h * self.scale + stopped + x


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_no_grad_regions_are_kept(tracer: str) -> None:
    """[Note: no_grad regions]: the graph run with gradients on computes the gradients the
    original does (nothing flows through the region), and writes the buffer `out=` as it."""
    torch.manual_seed(0)
    model, x = NoGradRegion(), torch.randn(3, 4)
    t = trace(model, (x,), {}, tracer)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    model(x1).square().sum().backward()
    want = [p.grad.clone() for p in model.parameters()] + [x1.grad]  # type: ignore[union-attr]
    scale = model.scale.clone()
    model.zero_grad()
    model.scale.zero_()
    out = t.gm(x2)
    (out[0] if isinstance(out, (list, tuple)) else out).square().sum().backward()  # the graph's one output leaf
    got = [p.grad for p in model.parameters()] + [x2.grad]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.scale, scale, rtol=0, atol=0)
