"""The engines that run a package under `runtime.DistributedPipeline(DIR, engine=NAME)`.

"partitioner" (the default) is the runtime's own schedule interpreter (distributed.py);
"pipelining" runs the same stages with torch.distributed.pipelining (pipelining.py).  Both
give the same results through the same API (docs/engines.md).
"""

from __future__ import annotations

from typing import Any

from ..errors import EngineError

__all__ = ["ENGINES", "DEFAULT_ENGINE", "check_engine", "engine_class"]

ENGINES = ("partitioner", "pipelining")
DEFAULT_ENGINE = "partitioner"


def check_engine(name: str) -> str:
    """`name` if it is an engine, else an EngineError listing them."""
    if name not in ENGINES:
        raise EngineError(f"unknown engine {name!r}: the engines are {', '.join(ENGINES)} "
                          f"(engine={DEFAULT_ENGINE!r} is the default).")
    return name


def engine_class(base: type[Any], name: str) -> type[Any]:
    """The DistributedPipeline class that runs engine `name` (`base` itself for the default)."""
    if check_engine(name) == DEFAULT_ENGINE or base.__name__ != "DistributedPipeline":
        return base
    from .pipelining import PipeliningPipeline  # imports distributed.py: not at module level

    return PipeliningPipeline
