"""The schedule IR: actions, the schedules' registry and builders, lowering to SEND/RECV,
validation.

A schedule is one list of `Action`s per pipeline RANK (pipeline position), run in order:

    actions.py     `Action` (`2F0`: stage 2, forward, microbatch 0), `Kind`, the text form
    builders.py    compute-only schedules: `gpipe`, `one_f_one_b`, `interleaved_1f1b`,
                   `zb_h1`, `zb_h2`, `zb_v` (their orders: runtime/zero_bubble.py)
    registry.py    every schedule a package may name, as a `ScheduleSpec` ([Note: V placement])
    graph.py       `StageGraph`: which stage feeds which, on which rank
    lowering.py    `lower` adds SEND/RECV ([Note: receives posted ahead])
    validation.py  `validate` simulates the ranks ([Note: schedule semantics]) and returns
                   the rank-by-step grid that the runtimes interpret

Nothing here runs a tensor: the runtimes only interpret what this package says.
"""

from __future__ import annotations

from .actions import (B, COMM, COMPUTE, RECV_B, RECV_F, SEND_B, SEND_F, Action, F, I, Kind, Schedule, W,
                      format_schedule, parse_schedule)
from .builders import gpipe, interleaved_1f1b, one_f_one_b, zb_h1, zb_h2, zb_v
from .graph import StageGraph
from .lowering import lower, receives_ahead
from .registry import (AUTO_SCHEDULES, DEFAULT_SCHEDULE, REGISTRY, SCHEDULES, ScheduleSpec, UnknownScheduleError,
                       make_schedule, placement, schedule_spec)
from .validation import Grid, execution_order, format_grid, validate

__all__ = [
    "SCHEDULES",
    "AUTO_SCHEDULES",
    "DEFAULT_SCHEDULE",
    "REGISTRY",
    "ScheduleSpec",
    "UnknownScheduleError",
    "schedule_spec",
    "Kind",
    "Action",
    "Schedule",
    "StageGraph",
    "COMPUTE",
    "COMM",
    "gpipe",
    "one_f_one_b",
    "interleaved_1f1b",
    "zb_h1",
    "zb_h2",
    "zb_v",
    "placement",
    "make_schedule",
    "lower",
    "receives_ahead",
    "validate",
    "execution_order",
    "format_schedule",
    "parse_schedule",
    "format_grid",
    "Grid",
    # the action kinds by letter, as schedules are written out (`from runtime.schedule import F, B`)
    "F",
    "B",
    "I",
    "W",
    "SEND_F",
    "RECV_F",
    "SEND_B",
    "RECV_B",
]
