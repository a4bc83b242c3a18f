"""The model file `partitioner.parallelize` writes for a model built in the user's script
([Note: recorded models] in runtime/recorded.py): the model's structure, the modules its
classes come from, and `loss_fn`, so that the package is self-contained as a compiled one is.

Where a class or the loss_fn comes from decides how the file reaches it:

    the script itself (`__main__`)        its file copied beside, as `<script>.py`; its
                                          `if __name__ == "__main__":` block does not run
    a user's top-level module (gpt.py)    copied beside, with the modules of its folder it
                                          imports (partitioner/trace/siblings.py)
    an installed or dotted module         imported by name (transformers, a package of yours
                                          on PYTHONPATH), as any other import of a model file
"""

from __future__ import annotations

import ast
import base64
import copy
import io
import pickle
import sys
import sysconfig
import textwrap
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from partitioner.errors import ParallelizeError
from partitioner.trace.siblings import sibling_modules

__all__ = ["MODEL_NAME", "Recorded", "record"]

#: the generated model file's name (what the package's manifest calls its source)
MODEL_NAME = "parallelized.py"
_INSTALLED = tuple(Path(p).resolve() for p in {sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")})


@dataclass
class Recorded:
    """The generated model file and the files it needs beside it (name -> bytes)."""

    text: bytes
    beside: dict[str, bytes] = field(default_factory=dict)

    def write(self, folder: Path) -> Path:
        """Write the model file and what it needs into `folder`; the model file's path."""
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in self.beside.items():
            (folder / name).write_bytes(data)
        (folder / MODEL_NAME).write_bytes(self.text)
        return folder / MODEL_NAME


def record(model: torch.nn.Module, loss_fn: Callable[..., Any] | None, key: str) -> Recorded:
    """The model file for `model` and `loss_fn`, stamped with the cache `key`."""
    modules = sorted({type(m).__module__ for m in model.modules()})
    loss_module = _loss_module(loss_fn) if loss_fn is not None else None
    imports = sorted(set(modules) | ({loss_module} if loss_module else set()))
    beside: dict[str, bytes] = {}
    names = {name: _import_name(name, beside) for name in imports}
    lines = _header(model) + [f"import {names[m]}" for m in imports if names[m] not in ("builtins",)]
    lines += ["", "from runtime.recorded import build_recorded"]
    if loss_fn is not None and loss_module is not None:
        lines += [f"from {names[loss_module]} import {loss_fn.__name__} as loss_fn"]
    renames = ", ".join(f"{m!r}: {names[m]}" for m in imports if names[m] != m)
    lines += ["", f"KEY = {key!r}  # partitioner.parallelize's cache key", "STRUCTURE = ("]
    lines += [f"    {chunk!r}" for chunk in textwrap.wrap(_structure(model), 96)] + [")", "", ""]
    lines += ["def build_model():", f"    return build_recorded(STRUCTURE, {{{renames}}})", ""]
    return Recorded("\n".join(lines).encode(), beside)


def _header(model: torch.nn.Module) -> list[str]:
    return [f'"""The model {type(model).__qualname__}, recorded by partitioner.parallelize: its structure with no',
            'parameter values, built again by build_model() ([Note: recorded models] in runtime/recorded.py)."""',
            ""]


def _structure(model: torch.nn.Module) -> str:
    """The model pickled with its parameters on the meta device, in base64."""
    memo: dict[int, Any] = {id(p): torch.nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
                            for _n, p in model.named_parameters(remove_duplicate=False)}
    buffer = io.BytesIO()
    try:
        _Pickler(buffer).dump(_buffers_on_cpu(copy.deepcopy(model, memo)))
    except Exception as exc:
        raise ParallelizeError(
            f"the model {type(model).__name__} cannot be recorded for its package: pickling its structure raised "
            f"{type(exc).__name__}: {exc}. parallelize keeps the model's modules and attributes (not its weights) in "
            f"the package; keep lambdas, open files and locks out of its attributes, or write a model file and "
            f"compile it (`python -m partitioner compile MODEL.py`).") from exc
    return base64.b64encode(buffer.getvalue()).decode()


def _buffers_on_cpu(model: torch.nn.Module) -> torch.nn.Module:
    """The copy's buffers moved to the CPU: the package names no device ([Note: devices in
    stage code] in codegen/stage.py)."""
    for module in model.modules():
        for name, value in module._buffers.items():
            if value is not None and value.device.type not in ("cpu", "meta"):
                module._buffers[name] = value.cpu()
    return model


class _Pickler(pickle.Pickler):
    """Sets pickled in sorted order, so the same model gives the same bytes in every process."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) in (set, frozenset):
            try:
                return type(obj), (sorted(obj),)
            except TypeError:
                return NotImplemented
        return NotImplemented


def _loss_module(loss_fn: Callable[..., Any]) -> str:
    """The module that defines `loss_fn` at its top level, or an error naming the fix."""
    name = getattr(loss_fn, "__qualname__", "")
    module = sys.modules.get(getattr(loss_fn, "__module__", None) or "")
    if not isinstance(loss_fn, types.FunctionType) or "<" in name or "." in name or module is None \
            or getattr(module, name, None) is not loss_fn:
        raise ParallelizeError(
            f"loss_fn {getattr(loss_fn, '__qualname__', repr(loss_fn))} is not a function defined at the top level "
            f"of a module, so the package cannot import it again (a lambda, a nested function, a bound method or a "
            f"functools.partial has no name to import): define `def loss_fn(output, target): ...` at the top level "
            f"of your script or of a module, and pass that.")
    return module.__name__


def _import_name(name: str, beside: dict[str, bytes]) -> str:
    """How the model file imports module `name`: its copy's name, after copying it (and the
    modules of its folder it imports) into `beside`, or `name` itself."""
    module = sys.modules.get(name)
    path = Path(getattr(module, "__file__", None) or "")
    if name == "__main__":
        _check_guarded(path)
    elif "." in name or not path.is_file() or path.suffix != ".py" or _installed(path):
        return name
    beside[path.name] = path.read_bytes()
    beside.update({k: v for k, v in sibling_modules(path).items() if k not in beside})
    return path.stem


def _installed(path: Path) -> bool:
    resolved = path.resolve()
    return any(resolved.is_relative_to(root) for root in _INSTALLED) or "site-packages" in resolved.parts


def _check_guarded(path: Path) -> None:
    """The script (`__main__`) can be imported without running: a file with its work under
    `if __name__ == "__main__":`."""
    if not path.is_file() or path.suffix != ".py":
        raise ParallelizeError(
            "the model's classes or loss_fn are defined in an interactive session (__main__ has no .py file), so "
            "the package cannot keep a copy of them: define them in a .py file (your script, or a module it "
            "imports) and call parallelize from there.")
    tree = ast.parse(path.read_bytes())
    if not any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body):
        raise ParallelizeError(
            f"{path.name} defines the model's classes or loss_fn, so the package keeps a copy of it and imports "
            f"it again, but it has no `if __name__ == \"__main__\":` block and importing it would run it: put "
            f"the training under `def main(): ...` and `if __name__ == \"__main__\": main()`, or move the model "
            f"and loss_fn into a module of their own.")
