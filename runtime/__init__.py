"""The pipeline runtime: reads a generated package DIR (manifest.json + stage_<k>.py) and
trains it, in one process (`LocalPipeline`) or one process per rank (`DistributedPipeline`).

It needs torch alone: it never imports the compiler (`partitioner`) or OR-Tools.  Stage
code compiled with tensor parallelism calls `runtime.tp` (tp.py), whose collectives run
over the group `DistributedPipeline` sets up.
"""

from __future__ import annotations

from .checkpoint import latest_checkpoint
from .distributed import DistributedPipeline
from .errors import PipelineError
from .initialize import init_weights
from .local import LocalPipeline
from .manifest import FORMAT_VERSION, SCHEDULES, Manifest
from .scaler import GradScaler
from .schedule import (
    Action,
    Kind,
    StageGraph,
    execution_order,
    format_grid,
    format_schedule,
    gpipe,
    interleaved_1f1b,
    lower,
    make_schedule,
    one_f_one_b,
    parse_schedule,
    validate,
)

__all__ = [
    "LocalPipeline",
    "DistributedPipeline",
    "PipelineError",
    "latest_checkpoint",
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
