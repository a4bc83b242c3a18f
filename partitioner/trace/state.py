"""State the forward changes on real tensors while torch.fx traces it: found, put back, refused.

[Note: state updated outside the graph]
    torch.fx records what the forward does to Proxies; what it does to real tensors runs
    once, while tracing, and leaves no node.  Reading `self.weight` gives a Proxy (a
    get_attr), but `self.teacher.buffers()` / `self.student.parameters()` give the real
    tensors, so a forward that loops over them (a MoCo/BYOL momentum teacher:
    `for t, s in zip(self.teacher.buffers(), self.student.parameters()): t.mul_(m).add_(s,
    alpha=1 - m)`) would update the model once at compile time and never in the stages.
    `watching_state` sees every write into a parameter's or buffer's storage while fx
    traces (a TorchDispatchMode: in-place and `out=` ops, through `.data` too) and every
    `p.data = ...` that rebinds one, puts each back as it was, and raises
    `StateUpdatedWhileTracing`: `--tracer auto` then traces with torch.export, which runs
    the forward on fake tensors and records in-place writes as nodes of the graph (a write
    through `.data` it refuses too, and the message says how to write it); `--tracer fx`
    refuses, naming the module, its line and `--tracer export`.  The update is never
    dropped.  Run once per call, it runs once per microbatch: `buffers.warn_state_updates`
    says so.
"""

from __future__ import annotations

import contextlib
import inspect
import linecache
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..cost.nodes import storage_key
from ..errors import TraceError

__all__ = ["StateUpdatedWhileTracing", "watching_state", "written_by"]


class StateUpdatedWhileTracing(TraceError):
    """A forward that changed real parameters or buffers while torch.fx traced it."""


class _Writes(TorchDispatchMode):
    """Records, before it runs, each op that writes into the storage of one of `owners`
    (storage -> name, tensor), keeping that tensor's value before its first write."""

    def __init__(self, owners: dict[int, tuple[str, torch.Tensor]], modules: dict[int, str]) -> None:
        super().__init__()
        self.owners, self.modules = owners, modules
        self.saved: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> (tensor, value before)
        self.where = ""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        for written in _written(func, args, kwargs):
            hit = self.owners.get(storage_key(written))
            if hit is not None and hit[0] not in self.saved:
                self.saved[hit[0]] = (hit[1], hit[1].detach().clone())
                self.where = self.where or _caller(self.modules)
        return func(*args, **kwargs)


@contextlib.contextmanager
def watching_state(model: torch.nn.Module) -> Iterator[None]:
    """Run the body (an fx trace of `model`); raise `StateUpdatedWhileTracing` if it wrote
    into, or rebound, a parameter or buffer of `model`, after putting each back
    ([Note: state updated outside the graph])."""
    datas = [(n, t, t.data) for n, t in [*model.named_parameters(), *model.named_buffers()]]
    mode = _writes_of(model)
    try:
        with mode:
            yield
    finally:
        rebound = [(name, tensor, data) for name, tensor, data in datas if storage_key(tensor) != storage_key(data)]
        for _name, tensor, data in rebound:
            tensor.data = data
        _put_back(mode)
    changed = list(mode.saved) + [name for name, _t, _d in rebound if name not in mode.saved]
    if changed:
        shown = ", ".join(changed[:4]) + (f" and {len(changed) - 4} more" if len(changed) > 4 else "")
        raise StateUpdatedWhileTracing(
            f"{mode.where or type(model).__name__ + '.forward()'} updates {shown} on the real tensors (a loop over "
            f"the modules' `.parameters()` / `.buffers()`, a momentum teacher's update), which torch.fx runs once while "
            f"tracing and cannot record, so the stages would never run it. torch.export records such an update "
            f"written as in-place ops under torch.no_grad() (`t.mul_(m).add_(s, alpha=1 - m)`, `t.copy_(...)`), not "
            f"through `.data` (`t.data.mul_(m)`, `t.data = ...`): write it so and compile with --tracer export (or "
            f"auto, which falls back to it).")


def written_by(model: torch.nn.Module, run: Callable[[], Any]) -> list[str]:
    """The parameters and buffers of `model` that `run()` writes in place, each put back as
    it was before."""
    mode = _writes_of(model)
    try:
        with mode:
            run()
    finally:
        _put_back(mode)
    return list(mode.saved)


def _writes_of(model: torch.nn.Module) -> _Writes:
    """A `_Writes` over every parameter and buffer of `model` (a tied tensor by its first name)."""
    named = [*model.named_parameters(), *model.named_buffers()]
    owners = {storage_key(t): (n, t) for n, t in reversed(named)}
    return _Writes(owners, {id(m): path for path, m in model.named_modules()})


def _put_back(mode: _Writes) -> None:
    """Each tensor `mode` saw written, as it was before its first write."""
    with torch.no_grad():
        for tensor, value in mode.saved.values():
            tensor.copy_(value)


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors an aten op writes: its arguments marked `(a!)` in its schema (`self` of
    an in-place op, `out=`, each tensor of a `_foreach_` op's list)."""
    schema = getattr(func, "_schema", None)
    found: list[torch.Tensor] = []
    for index, arg in enumerate(schema.arguments if schema is not None else ()):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = kwargs.get(arg.name, args[index] if index < len(args) and not arg.kwarg_only else None)
        found += [v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, torch.Tensor)]
    return found


def _caller(modules: dict[int, str]) -> str:
    """'<module>.forward() (<file>, line N: `<source>`)' for the innermost frame of the
    model's own code on the stack (a method of one of its modules, outside torch)."""
    frame = inspect.currentframe()
    while frame is not None:
        owner = frame.f_locals.get("self")
        code = frame.f_code
        if isinstance(owner, torch.nn.Module) and id(owner) in modules and "/torch/" not in code.co_filename.replace("\\", "/"):
            path = modules[id(owner)] or type(owner).__name__
            source = linecache.getline(code.co_filename, frame.f_lineno).strip()
            file = code.co_filename.replace("\\", "/").rsplit("/", 1)[-1]
            return f"{path}.{code.co_name}() ({file}, line {frame.f_lineno}: `{source}`)"
        frame = frame.f_back
    return ""
