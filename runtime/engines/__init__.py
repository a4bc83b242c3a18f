"""The engines that run a package under `runtime.DistributedPipeline(DIR, engine=NAME)`.

"partitioner" (the default) is the runtime's own schedule interpreter (distributed.py);
"pipelining" runs the same stages with torch.distributed.pipelining (pipelining.py, which
registers its class in `CLASSES` when imported: `runtime.DistributedPipeline` is exported
from there, so distributed.py needs no import of it).  Both give the same results through
the same API (docs/engines.md).
"""

from __future__ import annotations

from typing import Any

from ..errors import EngineError

__all__ = ["ENGINES", "DEFAULT_ENGINE", "CLASSES", "check_engine", "engine_class"]

ENGINES = ("partitioner", "pipelining")
DEFAULT_ENGINE = "partitioner"
CLASSES: dict[str, type[Any]] = {}  # engine -> its DistributedPipeline subclass, registered by its module


def check_engine(name: str) -> str:
    """`name` if it is an engine, else an EngineError listing them."""
    if name not in ENGINES:
        raise EngineError(f"unknown engine {name!r}: the engines are {', '.join(ENGINES)} "
                          f"(engine={DEFAULT_ENGINE!r} is the default).")
    return name


def engine_class(base: type[Any], name: str) -> type[Any]:
    """The DistributedPipeline class that runs engine `name`: `base` itself for the default,
    else the class registered for it (`CLASSES`, filled when engines/pipelining.py is
    imported, as `runtime.DistributedPipeline` does)."""
    if check_engine(name) == DEFAULT_ENGINE or getattr(base, "engine", None) == name:
        return base
    if name not in CLASSES:
        raise EngineError(f"engine={name!r} is not loaded: make the pipeline as runtime.DistributedPipeline(DIR, "
                          f"engine={name!r}) (importing runtime.engines.pipelining registers it).")
    return CLASSES[name]
