"""The user's own gradient checkpointing (torch.utils.checkpoint), traced as what it computes.

[Note: the user's checkpointing]
    torch.utils.checkpoint runs a region without keeping its activations and runs it again
    in backward. Neither tracer can record that as such: the reentrant form is one autograd
    Function handed the region's callable (fx would make it a call whose argument is a
    module; export records the forward it runs under no_grad and a detach, cutting every
    gradient to what comes before), and the non-reentrant form is inlined without a word.
    So while tracing (`inlined_checkpoints`) both forms are a plain call of the region,
    whose ops are traced like any others: checkpoint's two implementations are looked up
    in torch.utils.checkpoint's globals on every call, so a name imported before tracing
    (`from torch.utils.checkpoint import checkpoint`) and a Hugging Face model's
    `_gradient_checkpointing_func` (a partial of it) take the same way. The regions are
    recorded by the module they run (`Traced.checkpointed`), and the compile keeps the
    memory saving the user asked for as the plan's recomputation (`--recompute`: every stage
    runs its forward again in backward, a superset of the regions), or, under a mesh search,
    leaves it to the planner's choice and says so in one line (driver/phases.py,
    driver/search.py).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch
import torch.utils.checkpoint as checkpoint_module

__all__ = ["describe", "inlined_checkpoints"]


def _module_called(fn: Any) -> torch.nn.Module | None:
    """The module a checkpointed callable runs: the module itself, a bound method's owner,
    or the module a partial is given first (Hugging Face: `partial(forward, layer, ...)`)."""
    while isinstance(fn, functools.partial):
        given = next((a for a in fn.args if isinstance(a, torch.nn.Module)), None)
        if given is not None:
            return given
        fn = fn.func
    if isinstance(fn, torch.nn.Module):
        return fn
    owner = getattr(fn, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else None


class _Regions:
    """The checkpointed regions of one trace, named by module path, in the order first run."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.paths = {id(m): path for path, m in model.named_modules()}
        self.names: list[str] = []

    @contextlib.contextmanager
    def recording(self, fn: Callable[..., Any]) -> Iterator[None]:
        """The body runs the region of `fn`: recorded under the module it runs, else the
        first module called inside it (a lambda around a block), else its name."""
        called: list[torch.nn.Module] = []

        def seen(module: torch.nn.Module, _args: Any) -> None:
            called.append(module)

        with torch.nn.modules.module.register_module_forward_pre_hook(seen):
            yield
        module = _module_called(fn) or (called[0] if called else None)
        name = self.paths.get(id(module), "") if module is not None else ""
        name = name or getattr(fn, "__qualname__", type(fn).__name__)
        if name not in self.names:
            self.names.append(name)


@contextlib.contextmanager
def inlined_checkpoints(model: torch.nn.Module) -> Iterator[list[str]]:
    """In the body, torch.utils.checkpoint runs its region as a plain call; yields the
    checkpointed regions' names as they are found ([Note: the user's checkpointing])."""
    regions = _Regions(model)

    class Reentrant:  # stands in for CheckpointFunction: `apply(function, preserve, *args)`
        @staticmethod
        def apply(function: Callable[..., Any], _preserve: bool, *args: Any) -> Any:
            with regions.recording(function):
                return function(*args)

    def nonreentrant(function: Callable[..., Any], *_rest: Any, **_kwargs: Any) -> Iterator[None]:
        with regions.recording(function):  # checkpoint() runs `function` between its two next()
            yield

    stand_ins = {"CheckpointFunction": Reentrant, "_checkpoint_without_reentrant_generator": nonreentrant}
    saved = {name: getattr(checkpoint_module, name) for name in stand_ins}
    try:
        for name, stand_in in stand_ins.items():
            setattr(checkpoint_module, name, stand_in)
        yield regions.names
    finally:
        for name, original in saved.items():
            setattr(checkpoint_module, name, original)


def describe(regions: tuple[str, ...], limit: int = 6) -> str:
    """'blocks.0, blocks.1 and 2 more' for a message."""
    shown = ", ".join(regions[:limit])
    return shown + (f" and {len(regions) - limit} more" if len(regions) > limit else "")
