"""`partitioner.parallelize`'s keywords: the compile's options (`CompileOptions`, the one table
the command line fills too) by keyword, and the key that names a package in the cache.

[Note: the parallelize cache key]
    A package is reused when the key of the call that wrote it equals this call's: a sha256
    of the source files of the model's classes and of loss_fn's module, the model's repr
    and its config (Hugging Face's, when it has one), every parameter's and buffer's name,
    shape and dtype, the example batch's structure, shapes and dtypes (not its values), the
    options, the hardware (`hardware=`, else this machine's GPU or CPU) and the versions of
    torch and of the package format.  It is written into the generated model file (`KEY`),
    so the package itself says which call it serves.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from partitioner.errors import ParallelizeError
from runtime.manifest import FORMAT_VERSION

from .cli import parse_size
from .options import CompileOptions

__all__ = ["KEYWORDS", "cache_key", "compile_options"]

#: the options parallelize takes by keyword: every compile option but what it fills itself
KEYWORDS = tuple(f.name for f in dataclasses.fields(CompileOptions) if f.name not in ("model", "out", "entry"))
_UNPLANNED = ("quiet", "reprofile", "force")  # options that leave the package as it is: not in the key


def compile_options(model_path: str, out: str, options: dict[str, Any]) -> CompileOptions:
    """The compile's options from `parallelize`'s keywords; an unknown keyword is an error
    naming the known ones.  `memory` may be a size as the command line writes it ("16GiB")."""
    unknown = sorted(set(options) - set(KEYWORDS))
    if unknown:
        raise ParallelizeError(
            f"parallelize() got the unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: the options "
            f"are the command line's, as keywords ({', '.join(KEYWORDS)}), and engine= for the runtime; fix the "
            f"spelling (--virtual-stages is virtual_stages=).")
    given = dict(options)
    if isinstance(given.get("memory"), str):
        given["memory"] = parse_size(given["memory"])
    return CompileOptions(model=model_path, out=out, **given)


def cache_key(model: torch.nn.Module, example: Any, loss_fn: Callable[..., Any] | None,
              options: dict[str, Any]) -> str:
    """The package's key ([Note: the parallelize cache key])."""
    parts = {
        "sources": _sources(model, loss_fn),
        "model": repr(model),
        "config": _config(model),
        "tensors": [(n, list(t.shape), str(t.dtype)) for n, t in _tensors(model)],
        "example": _shapes(example),
        "loss_fn": None if loss_fn is None else f"{loss_fn.__module__}.{loss_fn.__qualname__}",
        "options": {k: repr(v) for k, v in sorted(options.items()) if k not in _UNPLANNED},
        "hardware": options.get("hardware") or _machine(),
        "versions": [torch.__version__, FORMAT_VERSION],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))


def _sources(model: torch.nn.Module, loss_fn: Callable[..., Any] | None) -> dict[str, str]:
    """module name -> sha256 of its source file, for the model's classes and loss_fn."""
    names = {type(m).__module__ for m in model.modules()} | ({loss_fn.__module__} if loss_fn is not None else set())
    found = {}
    for name in sorted(names):
        path = Path(getattr(sys.modules.get(name), "__file__", None) or "")
        found[name] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""
    return found


def _config(model: torch.nn.Module) -> str:
    """A Hugging Face model's config as JSON, else ""."""
    config = getattr(model, "config", None)
    to_json = getattr(config, "to_json_string", None)
    return to_json(use_diff=False) if callable(to_json) and "use_diff" in inspect.signature(to_json).parameters else ""


def _shapes(example: Any) -> Any:
    """The example batch's structure with each tensor as its shape and dtype."""
    leaves, spec = pytree.tree_flatten(example)
    return [str(spec), [[list(x.shape), str(x.dtype)] if isinstance(x, torch.Tensor) else repr(x) for x in leaves]]


def _machine() -> str:
    """This machine, as far as a plan depends on it: its GPU, else its CPU and core count."""
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()}"
    return f"{platform.machine()} {platform.processor()} {os.cpu_count()} cores"
