"""Custom autograd Functions (`class Round(torch.autograd.Function)`): kept whole, never inlined.

Both tracers would record a Function's *forward* as ordinary ops, whose derivative then
replaces the user's own backward (a straight-through estimator would get round's zero
gradient, a gradient-reversal layer the wrong sign).  So:

- under fx (`functions_as_leaves`), `Function.apply` is patched while tracing: a call on a
  traced value becomes one `call_function` node whose target is the user's `Round.apply`
  (the generated stage calls it, autograd runs its backward; costed as one node);
- a forward traced into all the same (called through an alias taken before tracing,
  `round_ste = Round.apply`) and every Function under torch.export (which inlines them,
  `recorded_functions`) are reported, so the trace fails with their names and the fix.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.fx
import torch.utils._pytree as pytree

from ..errors import TraceError

__all__ = ["function_of", "functions_as_leaves", "recorded_functions", "short_name"]

_APPLY = torch.autograd.Function.__dict__["apply"]


def function_of(target: Any) -> type | None:
    """The Function subclass when `target` is its `apply` (a node kept by fx), else None."""
    owner = getattr(target, "__self__", None)
    if getattr(target, "__name__", "") == "apply" and isinstance(owner, type) and issubclass(owner, torch.autograd.Function):
        return owner
    return None


def _traced(args: Any) -> bool:
    return any(isinstance(v, torch.fx.Proxy) for v in pytree.tree_leaves(args))


def _subclasses() -> list[type]:
    found: list[type] = []
    todo = list(torch.autograd.Function.__subclasses__())
    while todo:
        cls = todo.pop()
        if cls not in found:
            found.append(cls)
            todo += cls.__subclasses__()
    return found


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def short_name(name: str) -> str:
    """A Function's name without the private module name of a model file."""
    module, _, rest = name.partition(".")
    return rest if module.startswith("_partitioner_model") else name


@contextlib.contextmanager
def _watching_forwards(seen: Callable[[type, Any], None]) -> Iterator[None]:
    """Call `seen(cls, (args, kwargs))` whenever a user Function's forward runs in the body."""
    patched: list[tuple[type, Any]] = []

    def watch(cls: type) -> None:
        original = cls.__dict__["forward"]
        inner: Callable[..., Any] = original.__func__ if isinstance(original, staticmethod) else original

        def forward(*args: Any, **kwargs: Any) -> Any:
            seen(cls, (args, kwargs))
            return inner(*args, **kwargs)

        patched.append((cls, original))
        cls.forward = staticmethod(forward) if isinstance(original, staticmethod) else forward  # type: ignore[attr-defined]

    try:
        for cls in _subclasses():
            if "forward" in cls.__dict__ and cls.__module__.split(".")[0] != "torch":
                watch(cls)
        yield
    finally:
        for cls, original in patched:
            cls.forward = original  # type: ignore[attr-defined]


def _refuse_modules(cls: type, args: Any) -> None:
    """A Function handed a module cannot be one call in a stage: the stage holds the module's
    parameters, not the module (torch.utils.checkpoint's own Function never gets here:
    [Note: the user's checkpointing] in checkpointing.py)."""
    module = next((v for v in pytree.tree_leaves(args) if isinstance(v, torch.nn.Module)), None)
    if module is not None:
        raise TraceError(f"{short_name(_name(cls))}.apply(...) is given a module ({type(module).__name__}) as an argument, "
                         f"which a pipeline stage cannot pass on (it holds the module's parameters, not the module): "
                         f"pass the tensors the Function needs (the module's weights) instead of the module.")


@contextlib.contextmanager
def functions_as_leaves(tracer: torch.fx.Tracer, inlined: list[str]) -> Iterator[None]:
    """While fx traces: `F.apply(proxy, ...)` is one node; a Function forward run on proxies
    some other way appends its class name to `inlined`."""

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        if _traced((args, kwargs)):
            _refuse_modules(cls, (args, kwargs))
            return tracer.create_proxy("call_function", _APPLY.__get__(None, cls), args, kwargs)
        return _APPLY.__get__(None, cls)(*args, **kwargs)

    def seen(cls: type, args: Any) -> None:
        if _traced(args) and _name(cls) not in inlined:
            inlined.append(_name(cls))

    torch.autograd.Function.apply = classmethod(apply)  # type: ignore[assignment, method-assign]
    try:
        with _watching_forwards(seen):
            yield
    finally:
        torch.autograd.Function.apply = _APPLY  # type: ignore[method-assign]


@contextlib.contextmanager
def recorded_functions(called: list[str]) -> Iterator[None]:
    """Append the name of every user Function whose forward runs in the body to `called`
    (torch.export inlines their forwards)."""

    def seen(cls: type, _args: Any) -> None:
        if _name(cls) not in called:
            called.append(_name(cls))

    with _watching_forwards(seen):
        yield
