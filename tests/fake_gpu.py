"""The fake-GPU check: every stage of a package runs its forward with every parameter,
buffer and input on a fake `cuda` device, on a CPU-only build.

Under `FakeTensorMode` no kernel runs (shapes and devices only), so this works without a
GPU; a tensor left on the CPU in the stage's code (a device written as a constant, a
factory call without a device) meets a `cuda` one and raises
`FakeTensorDeviceMismatchError` ([Note: devices in stage code] in codegen/stage.py).
Forward only, under `no_grad`: autograd on fake CUDA tensors is not available in a CPU
build.  With tp > 1 the collectives of `runtime.tp` keep only their shapes (`_shapes_only`):
this checks devices, not values.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode

from runtime import package, tp

__all__ = ["check_stages_on_fake_gpu"]

FAKE = torch.device("cuda", 0)


def check_stages_on_fake_gpu(directory: str | Path) -> None:
    """Run each stage of package `directory` once on fake CUDA tensors (raises on a mismatch)."""
    manifest = package.load_manifest(directory)
    with _shapes_only(manifest.mesh.tp):
        for k, spec in enumerate(manifest.stages):
            module = package.import_stage(directory, manifest, k)
            with FakeTensorMode(allow_non_fake_inputs=False):
                _to_fake_cuda(module)
                args = [_empty(i.shape, i.dtype) for i in spec.inputs]
                with torch.no_grad(), _MetaDetour():
                    module(*args)


def _to_fake_cuda(module: torch.nn.Module) -> None:
    """Replace every parameter and buffer by an empty fake tensor on `cuda` of its shape."""
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None:
                sub._parameters[name] = torch.nn.Parameter(_empty(p.shape, p.dtype), p.requires_grad)
        for name, b in list(sub._buffers.items()):
            if b is not None:
                sub._buffers[name] = _empty(b.shape, b.dtype)


def _empty(shape: Any, dtype: torch.dtype | str | None) -> torch.Tensor:
    """An empty fake tensor on `cuda` (a manifest's dtype is a name: "float32")."""
    kind = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return torch.empty(tuple(shape), dtype=kind, device=FAKE)


class _MetaDetour(TorchFunctionMode):
    """Runs the few Tensor methods whose Python binding takes a device guard before
    dispatch (indexing, `contiguous`) on meta stand-ins of their fake CUDA operands.

    A CPU build has no CUDA device guard ("PyTorch is not linked with support for cuda
    devices"), so these methods fail on a fake CUDA tensor before FakeTensorMode sees
    them.  The stand-ins have the same shapes and strides; the result comes back as a
    fake CUDA tensor of the result's shape (a copy, not a view: devices are all this
    check looks at)."""

    GUARDED = {torch.Tensor.__getitem__, torch.Tensor.contiguous}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func not in self.GUARDED or not _on_fake_cuda(args[0]):
            return func(*args, **kwargs)
        out = func(*_map_tensors(_to_meta, args), **_map_tensors(_to_meta, kwargs))
        return _map_tensors(lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=FAKE), out)


def _on_fake_cuda(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "cuda"


def _to_meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") if _on_fake_cuda(t) else t


def _map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    return pytree.tree_map_only(torch.Tensor, fn, value)


@contextlib.contextmanager
def _shapes_only(size: int) -> Iterator[None]:
    """Within: runtime.tp's collectives as rank 0 of a group of `size` would shape them,
    without communicating (identity where the shape does not change)."""
    if size == 1:
        yield
        return
    saved = {name: getattr(tp, name) for name in ("all_gather", "scatter", "reduce_scatter")}
    tp.all_gather = lambda x, dim, blocks=1: tp.join_shards([x] * size, dim, blocks)  # type: ignore[assignment]
    tp.scatter = lambda x, dim, blocks=1: tp.local_shard(x, dim, 0, size, blocks)  # type: ignore[assignment]
    tp.reduce_scatter = tp.scatter  # type: ignore[assignment]
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(tp, name, fn)

