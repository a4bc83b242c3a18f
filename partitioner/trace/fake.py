"""Shape-only tensors that autocast applies to: a model built on the meta device, run as
fake CPU tensors while its dtypes and costs are found.

[Note: mixed precision on the meta device]
    Autocast picks its kernels by the tensors' backend, and the meta device has no autocast
    key: a meta model run under `torch.autocast` computes in float32, so the dtypes it
    gives the stage boundaries, their messages and the activations would be fp32's.  So a
    model built on the meta device (`--analytic` on a model too large to build here,
    `--meta`) is traced on meta tensors as always, but the passes that run the graph
    (`propagate`, `probe`, the node and loss costs) run it on FakeTensors
    (`torch._subclasses.FakeTensorMode`) that say they live on the CPU: shapes and
    dtypes, no storage, and autocast's CPU lists applied as they are to the real model a
    compile with real weights runs on the CPU.  `on_fake_cpu` swaps the graph's meta
    tensors for such fakes while it is entered and puts them back after; `to_meta` turns
    the values found into meta tensors of the same shapes and dtypes, so everything after
    the costs sees the meta values a meta compile always had.  The package is the one a
    compile with real weights writes: the same boundary dtypes and message sizes
    (tests/test_precision.py).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

__all__ = ["on_fake_cpu", "to_meta"]


@contextlib.contextmanager
def on_fake_cpu(gm: torch.fx.GraphModule, inputs: Any) -> Iterator[Any]:
    """While entered: `gm`'s meta parameters, buffers and tensor attributes are fake CPU
    tensors, a fake mode is active (tensors made inside it are fakes too), and what it
    yields is `inputs` (any pytree) with its meta tensors as fake CPU tensors."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    made: dict[int, torch.Tensor] = {}  # a tied weight stays one tensor

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            made[id(t)] = _fake_like(t)
        return made[id(t)]

    swapped: list[tuple[torch.nn.Module, str, str, torch.Tensor]] = []
    with mode:
        try:
            for module, name, kind, t in _meta_tensors(gm):
                swapped.append((module, name, kind, t))
                _put(module, name, kind, fake(t))
            yield pytree.tree_map_only(torch.Tensor, lambda t: fake(t) if t.is_meta else t, inputs)
        finally:
            for module, name, kind, t in reversed(swapped):
                _put(module, name, kind, t)


def to_meta(values: dict[torch.fx.Node, Any]) -> dict[torch.fx.Node, Any]:
    """`values` with each FakeTensor as a meta tensor of its shape, strides, dtype and
    requires_grad (a value with no FakeTensor in it kept as it is)."""
    def meta(t: FakeTensor) -> torch.Tensor:
        out = torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device="meta")
        return out.requires_grad_(t.requires_grad) if t.is_floating_point() or t.is_complex() else out

    def convert(value: Any) -> Any:
        if not any(isinstance(t, FakeTensor) for t in pytree.tree_leaves(value)):
            return value
        return pytree.tree_map_only(FakeTensor, meta, value)

    return {node: convert(value) for node, value in values.items()}


def _fake_like(t: torch.Tensor) -> torch.Tensor:
    """A fake CPU tensor with `t`'s shape, strides and dtype (a Parameter for a Parameter);
    call inside the fake mode."""
    out = torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device="cpu")
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(out, requires_grad=t.requires_grad)
    return out.requires_grad_(t.requires_grad) if t.requires_grad else out


def _meta_tensors(gm: torch.nn.Module) -> list[tuple[torch.nn.Module, str, str, torch.Tensor]]:
    """(owning module, attribute, kind, tensor) of every meta parameter, buffer and plain
    tensor attribute under `gm` (a shared module once)."""
    found = []
    for module in dict.fromkeys(m for _, m in gm.named_modules(remove_duplicate=False)):
        for name, p in module._parameters.items():
            if p is not None and p.is_meta:
                found.append((module, name, "parameter", p))
        for name, b in module._buffers.items():
            if b is not None and b.is_meta:
                found.append((module, name, "buffer", b))
        for name, v in vars(module).items():
            if isinstance(v, torch.Tensor) and v.is_meta:
                found.append((module, name, "attribute", v))
    return found


def _put(module: torch.nn.Module, name: str, kind: str, t: torch.Tensor) -> None:
    if kind == "parameter":
        module._parameters[name] = t  # type: ignore[assignment]
    elif kind == "buffer":
        module._buffers[name] = t
    else:
        setattr(module, name, t)
