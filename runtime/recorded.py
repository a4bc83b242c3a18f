"""A model recorded by `partitioner.parallelize`, built again from its package's model file.

[Note: recorded models]
    A model built in the user's script has no `build_model()` to call again, so
    `parallelize` records its structure: the model pickled with every parameter on the meta
    device (modules, attributes, buffers with their values, parameter shapes and ties; no
    parameter values), base64 in the generated model file's `STRUCTURE`, which the package
    keeps as its copy ([Note: the model file's copy] in runtime/manifest.py).  Its
    `build_model()` unpickles it: under `torch.device("meta")` (what `pipe.init_weights`
    asks for) the parameters stay on meta; otherwise each is materialised and given
    `init_weights(model, seed=0)`'s values, as a model file's model is built with its seed.
    Classes the script itself defined (`__main__`) are read from the script's copy beside
    the model file (`renames`); every other class from its module, by name.  Buffers keep
    their recorded values: the non-persistent ones (RoPE's `inv_freq`) reach the package
    through the compile's constants.
"""

from __future__ import annotations

import base64
import functools
import importlib
import io
import pickle
import types
from typing import Any

import torch

from .initialize import init_weights

__all__ = ["build_recorded"]


def build_recorded(structure: str, renames: dict[str, types.ModuleType]) -> torch.nn.Module:
    """The recorded model ([Note: recorded models]): meta parameters under
    `torch.device("meta")`, else materialised on the default device with `init_weights`'s
    values for seed 0."""
    model = _Unpickler(io.BytesIO(base64.b64decode(structure)), renames).load()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"the recorded structure holds a {type(model).__name__}, not a torch.nn.Module")
    device = torch.get_default_device()
    if device.type == "meta":
        return model
    _materialise(model, device)
    return init_weights(model, seed=0)


def _materialise(model: torch.nn.Module, device: torch.device) -> None:
    """Each meta parameter replaced by an empty one on `device`; a parameter held by several
    modules (tied) stays one parameter."""
    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.device.type == "meta":
                if id(p) not in made:
                    made[id(p)] = torch.nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                module._parameters[name] = made[id(p)]


class _Unpickler(pickle.Unpickler):
    """Classes of a renamed module (the script's `__main__`) read from its copy."""

    def __init__(self, file: io.BytesIO, renames: dict[str, types.ModuleType]) -> None:
        super().__init__(file)
        self.renames = renames

    def find_class(self, module: str, name: str) -> Any:
        if module in self.renames:
            return functools.reduce(getattr, name.split("."), self.renames[module])
        importlib.import_module(module)
        return super().find_class(module, name)
