"""The model's own output classes at run time ([Note: output classes] in
partitioner/trace/outputs.py): a dataclass the model returns is registered as a pytree node,
so that the runtime cuts, joins and moves its fields as it does a tuple's; outputs gathered
from another rank name a class of the model file by its name in the model file."""

from __future__ import annotations

import dataclasses
import functools
import io
import pickle
import types
from typing import Any, Callable, TypeVar

import torch.distributed as dist
import torch.utils._pytree as pytree

from .model_file import MODULE_PREFIX

__all__ = ["REGISTERED", "all_gather", "register_classes", "register_output", "registered"]

T = TypeVar("T", bound=type)

#: the classes `register_output` registered in this process (the compiler writes a call of
#: it into the last stage for these alone: another class pytree knows by itself)
REGISTERED: set[type] = set()


def registered(cls: type) -> bool:
    """Whether pytree flattens instances of `cls` (a node type it knows, a namedtuple, a
    structseq), rather than taking them as one leaf."""
    return cls in pytree.SUPPORTED_NODES or pytree.is_namedtuple_class(cls) or pytree.is_structseq_class(cls)


def register_output(cls: T) -> T:
    """`cls`, a dataclass the model returns, registered as a pytree node of its init fields
    unless pytree knows it already (a Hugging Face ModelOutput registers itself)."""
    if dataclasses.is_dataclass(cls) and not registered(cls):
        pytree.register_dataclass(cls)
        REGISTERED.add(cls)
    return cls


def register_classes(value: Any) -> None:
    """Register every dataclass instance in `value`, at any depth, that pytree would take
    as one leaf."""
    while True:
        found = {type(leaf) for leaf in pytree.tree_leaves(value)
                 if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type) and not registered(type(leaf))}
        if not found:
            return
        for cls in found:
            register_output(cls)


def all_gather(value: Any, world: int, group: Any, model_file: Callable[[], types.ModuleType]) -> list[Any]:
    """Every rank's `value` (`dist.all_gather_object`), a class of the package's model file
    in it sent as its name there: the module that file is imported as is this process's own
    (`_pipeline_model_<n>`, runtime/model_file.py), which another rank may not hold, so the
    receiver reads the class from its own import of the file, `model_file()`; a dataclass
    in it is registered here as where it was made (`register_classes`)."""
    buffer = io.BytesIO()
    _Pickler(buffer).dump(value)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, buffer.getvalue(), group=group)
    values = [_Unpickler(io.BytesIO(data), model_file).load() for data in gathered]
    register_classes(values)
    return values


class _Pickler(pickle.Pickler):
    """A class of the model file pickled as ("model file", its qualified name)."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, type) and obj.__module__.startswith(MODULE_PREFIX):
            return ("model file", obj.__qualname__)
        return None


class _Unpickler(pickle.Unpickler):
    """A class of the model file read from `model_file()`, this process's import of it."""

    def __init__(self, file: io.BytesIO, model_file: Callable[[], types.ModuleType]) -> None:
        super().__init__(file)
        self.model_file = model_file

    def persistent_load(self, pid: Any) -> Any:
        _kind, qualname = pid
        return functools.reduce(getattr, qualname.split("."), self.model_file())
