"""The schedule IR's actions: what one rank does in one step, and schedules as text.

A schedule is one list of `Action`s per pipeline RANK (pipeline position), run in order
([Note: schedule semantics] in validation.py).  `format_schedule` and `parse_schedule`
write and read one line per rank, as the tests lay schedules out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from ..errors import ScheduleError

__all__ = [
    "Kind",
    "Action",
    "Schedule",
    "COMPUTE",
    "COMM",
    "format_schedule",
    "parse_schedule",
]


class Kind(str, Enum):
    """What an action does: compute (F, B) or move a value to or from a peer stage."""

    F = "F"
    B = "B"
    I = "I"  # noqa: E741  (the input-gradient half of B: [Note: split backward] in stage.py)
    W = "W"  # the weight-gradient half of B, after the I of the same stage and microbatch
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    def __str__(self) -> str:  # "F", in messages and traces, as the action's repr writes it
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def is_send(self) -> bool:
        return self in (Kind.SEND_F, Kind.SEND_B)

    @property
    def is_backward(self) -> bool:
        """B, I, W, or a message of the backward pass (a gradient)."""
        return self in (Kind.B, Kind.I, Kind.W, Kind.SEND_B, Kind.RECV_B)

    @property
    def sends_grads(self) -> bool:
        """B or I: the action that makes the stage's input gradients (what SEND_B sends)."""
        return self in (Kind.B, Kind.I)


F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W
SEND_F, RECV_F, SEND_B, RECV_B = Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B
COMPUTE = (F, B, I, W)
COMM = (SEND_F, RECV_F, SEND_B, RECV_B)
_ACTION = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)(?:([<>])(\d+))?$")


@dataclass(frozen=True)
class Action:
    """One step of one stage: `2F0` is stage 2, forward, microbatch 0.

    Point-to-point actions name the peer stage: `0SEND_F1>2` sends stage 0's activations
    of microbatch 1 to stage 2; `2RECV_F1<0` receives them there.
    """

    stage: int
    kind: Kind
    microbatch: int
    peer: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):  # a name ("F", "SEND_B") is accepted and stored as its Kind
            if self.kind not in Kind.__members__:
                raise ScheduleError(f"unknown action kind {self.kind!r}: use one of {', '.join(Kind.__members__)}.")
            object.__setattr__(self, "kind", Kind(self.kind))
        if (self.kind in COMM) != (self.peer is not None):
            raise ScheduleError(f"action {self.kind.value} of stage {self.stage}: SEND/RECV actions and only they name a peer stage.")

    def __repr__(self) -> str:
        base = f"{self.stage}{self.kind.value}{self.microbatch}"
        if self.peer is None:
            return base
        return f"{base}{'>' if self.kind.is_send else '<'}{self.peer}"

    __str__ = __repr__

    @staticmethod
    def from_str(text: str) -> "Action":
        """Parse `2F0`, `1B3`, `0SEND_F1>2`, `2RECV_B0<3`."""
        match = _ACTION.match(text.strip())
        if not match:
            raise ScheduleError(f"{text!r} is not an action: write e.g. 2F0, 1B3, 0SEND_F1>2 or 2RECV_F1<0.")
        stage, kind, mb, arrow, peer = match.groups()
        if peer is not None and (arrow == ">") != kind.startswith("SEND"):
            raise ScheduleError(f"{text!r}: a SEND points to its peer with '>', a RECV from it with '<'.")
        return Action(int(stage), Kind(kind), int(mb), None if peer is None else int(peer))

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE


Schedule = list[list[Action]]


def format_schedule(schedule: Schedule) -> str:
    """One line per rank, actions separated by spaces (the inverse of `parse_schedule`)."""
    return "\n".join(" ".join(repr(a) for a in row) for row in schedule)


def parse_schedule(text: str) -> Schedule:
    """Lines of actions, one line per rank; blank lines are skipped."""
    return [[Action.from_str(tok) for tok in line.split()] for line in text.strip().splitlines() if line.strip()]
