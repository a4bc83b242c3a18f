"""Trace, cost and solve: the planning half of the compiler.

`partitioner.parallelize(model, example_inputs, loss_fn=None, *, out=None, **options)` compiles
a model built in the user's script and returns its pipeline (driver/parallelize.py,
docs/from-your-script.md).  It is imported when first read (PEP 562), so `import partitioner`
stays light: the driver above the planner is loaded only by a script that calls it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from driver.parallelize import parallelize

__all__ = ["parallelize"]


def __getattr__(name: str) -> Any:
    if name == "parallelize":
        return importlib.import_module("driver.parallelize").parallelize
    raise AttributeError(f"module 'partitioner' has no attribute {name!r}")
