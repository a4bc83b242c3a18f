"""Load a user's model file and check it against the model-file convention.

The convention (README.md, "Use"; the examples/ follow it): module-level `build_model()` returning an
`nn.Module`, `example_inputs()` returning a tuple of positional arguments or a dict of
keyword arguments, and for training `example_target()` and `loss_fn(output, target)`.
Every way a file can break the convention is a `ModelFileError` naming the file, the
name and the fix.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import traceback
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import ModelFileError
from .inputs import InputKey, forward_names, leaf_batch_dims

__all__ = ["ModelFile", "load", "split_example", "user_frame"]


def split_example(value: Any) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """One example batch as (args, kwargs): a dict of keyword arguments, a tuple or list of
    positional ones, or one tensor; None for anything else (the caller says what it wanted)."""
    if isinstance(value, dict):
        return (), dict(value)
    if isinstance(value, torch.Tensor):
        return (value,), {}
    if isinstance(value, (tuple, list)):
        return tuple(value), {}
    return None


@dataclass
class ModelFile:
    """An imported model file and what it provides."""

    path: str  # as the user gave it
    module: types.ModuleType
    sha256: str
    entry: str = "build_model"
    text: bytes = b""  # the file's bytes, as hashed: what the package keeps a copy of

    @property
    def batch_dims(self) -> dict[Any, int]:
        dims = getattr(self.module, "BATCH_DIMS", {})
        if not isinstance(dims, dict):
            raise ModelFileError(
                f"{self.path}: BATCH_DIMS must be a dict mapping an input's position, "
                f"name or dotted path to its batch dimension, e.g. {{0: 1}} or {{'hidden.0': 1}}; got {type(dims).__name__}."
            )
        return dims

    def leaf_batch_dims(self, model: torch.nn.Module, args: tuple[Any, ...],
                        kwargs: dict[str, Any]) -> dict[InputKey, int]:
        """The batch dimension of each tensor leaf of the batch `args`/`kwargs` that BATCH_DIMS
        names ([Note: input leaves] in inputs.py); every other leaf's is 0."""
        return leaf_batch_dims(self.batch_dims, forward_names(model), args, kwargs, self.path)

    def build(self, seed: int) -> torch.nn.Module:
        """`torch.manual_seed(seed)` then the entry function, checked."""
        fn = self._function(self.entry, "must build and return the model")
        torch.manual_seed(seed)
        model = self._call(fn, self.entry)
        if not isinstance(model, torch.nn.Module):
            raise ModelFileError(
                f"{self.path}: {self.entry}() returned {type(model).__name__}, not a "
                f"torch.nn.Module: return the model itself, e.g. `return MyNet()`."
            )
        return model

    def example_inputs(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The example batch as (args, kwargs)."""
        fn = self._function("example_inputs", "must return one example batch")
        value = self._call(fn, "example_inputs")
        split = split_example(value)
        if split is not None:
            return split
        raise ModelFileError(
            f"{self.path}: example_inputs() returned {type(value).__name__}; return a "
            f"tuple of positional arguments or a dict of keyword arguments."
        )

    def example_target(self) -> Any:
        fn = self._function("example_target", "is needed for training")
        return self._call(fn, "example_target")

    def loss_fn(self) -> Callable[[Any, Any], torch.Tensor]:
        return self._function("loss_fn", "is needed for training: loss_fn(output, target)")

    def has(self, name: str) -> bool:
        return callable(getattr(self.module, name, None))

    def _function(self, name: str, why: str) -> Callable[..., Any]:
        fn = getattr(self.module, name, None)
        if fn is None:
            raise ModelFileError(
                f"{self.path} defines no `{name}()`, which {why}: add a module-level "
                f"`def {name}(...)` (see README.md, \"Use\", and examples/)."
            )
        if not callable(fn):
            raise ModelFileError(f"{self.path}: `{name}` is a {type(fn).__name__}, not a function.")
        return fn  # type: ignore[no-any-return]

    def _call(self, fn: Callable[[], Any], name: str) -> Any:
        try:
            return fn()
        except Exception as exc:
            where = user_frame(exc, self.path)
            raise ModelFileError(
                f"{self.path}: {name}() raised {type(exc).__name__}: {exc}{where}. "
                f"Fix the model file so that {name}() runs on its own."
            ) from exc


def load(path: str, entry: str = "build_model") -> ModelFile:
    """Import the file at `path` under a private module name."""
    file = Path(path)
    if not file.is_file():
        hint = "it is a directory" if file.is_dir() else "no such file"
        raise ModelFileError(f"model file {path!r} cannot be read ({hint}): give the path of a .py file.")
    source = file.read_bytes()
    digest = hashlib.sha256(source).hexdigest()
    try:
        code = compile(source, str(file), "exec")
    except SyntaxError as exc:
        raise ModelFileError(
            f"{path}, line {exc.lineno}: syntax error: {exc.msg}"
            f"{': ' + exc.text.strip() if exc.text else ''}. Fix the file and compile again."
        ) from None
    name = f"_partitioner_model_{digest[:12]}"
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(file.parent.resolve()))
    try:
        exec(code, module.__dict__)
    except Exception as exc:
        del sys.modules[name]
        raise ModelFileError(
            f"{path}: importing it raised {type(exc).__name__}: {exc}{user_frame(exc, path)}. "
            f"A model file must import cleanly (install what it imports, or fix the line)."
        ) from exc
    finally:
        sys.path.remove(str(file.parent.resolve()))
    return ModelFile(path=path, module=module, sha256=digest, entry=entry, text=source)


def user_frame(exc: BaseException, path: str, shown: str | None = None) -> str:
    """' at <shown>, line N: <source>' for the deepest frame of `exc` in the user's file
    `path` (`shown`: how to name it, default `path`)."""
    target = str(Path(path).resolve())
    found = ""
    for frame in traceback.extract_tb(exc.__traceback__):
        if str(Path(frame.filename).resolve()) == target:
            found = f" at {shown or path}, line {frame.lineno}: `{(frame.line or '').strip()}`"
    if not found and exc.__cause__ is not None and exc.__cause__ is not exc:
        return user_frame(exc.__cause__, path, shown)
    return found
