"""The pipeline runtime: reads a generated package DIR (manifest.json + stage_<k>.py) and
trains it, in one process (`LocalPipeline`) or one process per rank (`DistributedPipeline`).

It needs torch alone: it never imports the compiler (`partitioner`) or OR-Tools.  Stage
code compiled with tensor parallelism calls `runtime.tp` (tp.py), whose collectives run
over the group `DistributedPipeline` sets up.

[Note: lazy runtime]
    Importing `runtime` loads none of its modules: each public name is imported from its
    module when first read (PEP 562's module `__getattr__`, `_EXPORTS` below), and so is
    a submodule read as an attribute (`runtime.tp`).  The planner imports the schedule
    registry (runtime/schedule/registry.py) through this package, and must not pay for
    the distributed runtime, checkpoints or torch.distributed when it does
    (tests/test_layers.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the names are, for the type checker; at run time `__getattr__` imports them
    from .checkpoint import latest_checkpoint, load_latest
    from .distributed import DistributedPipeline
    from .errors import PipelineError
    from .initialize import init_weights
    from .local import LocalPipeline
    from .manifest import FORMAT_VERSION, Manifest
    from .scaler import GradScaler, NonFiniteSteps, finite_step
    from .schedule import (SCHEDULES, Action, Kind, StageGraph, execution_order, format_grid, format_schedule, gpipe,
                           interleaved_1f1b, lower, make_schedule, one_f_one_b, parse_schedule, validate)

__all__ = [
    "LocalPipeline",
    "DistributedPipeline",
    "PipelineError",
    "latest_checkpoint",
    "load_latest",
    "finite_step",
    "NonFiniteSteps",
    "init_weights",
    "GradScaler",
    "Manifest",
    "FORMAT_VERSION",
    "SCHEDULES",
    "Action",
    "Kind",
    "StageGraph",
    "gpipe",
    "one_f_one_b",
    "interleaved_1f1b",
    "make_schedule",
    "lower",
    "validate",
    "execution_order",
    "format_schedule",
    "parse_schedule",
    "format_grid",
]

#: each public name's module ([Note: lazy runtime])
_EXPORTS = {
    "LocalPipeline": "local",
    "DistributedPipeline": "engines.pipelining",  # the class of distributed.py, its engines registered
    "PipelineError": "errors",
    "latest_checkpoint": "checkpoint",
    "load_latest": "checkpoint",
    "finite_step": "scaler",
    "NonFiniteSteps": "scaler",
    "init_weights": "initialize",
    "GradScaler": "scaler",
    "Manifest": "manifest",
    "FORMAT_VERSION": "manifest",
    "SCHEDULES": "schedule",
    "Action": "schedule",
    "Kind": "schedule",
    "StageGraph": "schedule",
    "gpipe": "schedule",
    "one_f_one_b": "schedule",
    "interleaved_1f1b": "schedule",
    "make_schedule": "schedule",
    "lower": "schedule",
    "validate": "schedule",
    "execution_order": "schedule",
    "format_schedule": "schedule",
    "parse_schedule": "schedule",
    "format_grid": "schedule",
}


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use; or a submodule ([Note: lazy runtime])."""
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    else:
        value = _submodule(name)
    globals()[name] = value  # read once: the next lookup finds it without this function
    return value


def _submodule(name: str) -> Any:
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise  # the submodule exists but needs something missing: say so
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
