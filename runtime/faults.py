"""A fault-injection hook for tests: PIPELINE_FAULT="RANK:ACTION[:exit|raise|hang]".

Right before ACTION (e.g. `1B0`), rank RANK exits at once (os._exit(13), as if killed),
raises a RuntimeError, or hangs; the other ranks must then fail with a clear message.
"""

from __future__ import annotations

import os
import sys
import time

from .errors import PipelineError
from .schedule import Action

__all__ = ["Fault", "parse_fault"]

_MODES = ("exit", "raise", "hang")


class Fault:
    """Where and how this process is to fail."""

    def __init__(self, rank: int, action: str, mode: str) -> None:
        self.rank, self.action, self.mode = rank, action, mode

    def check(self, rank: int, action: Action) -> None:
        """Fail now if this is the chosen rank and action."""
        if rank != self.rank or repr(action) != self.action:
            return
        print(f"PIPELINE_FAULT: rank {rank} stops before {action!r} ({self.mode})", file=sys.stderr, flush=True)
        if self.mode == "raise":
            raise RuntimeError(f"PIPELINE_FAULT: rank {rank} raised before {action!r}")
        if self.mode == "hang":
            while True:
                time.sleep(60)
        os._exit(13)


def parse_fault(text: str) -> Fault | None:
    """The fault PIPELINE_FAULT asks for, or None."""
    if not text:
        return None
    parts = text.split(":")
    if len(parts) not in (2, 3) or not parts[0].isdigit() or (len(parts) == 3 and parts[2] not in _MODES):
        raise PipelineError(f"PIPELINE_FAULT={text!r}: write RANK:ACTION[:exit|raise|hang], e.g. 1:1B0.")
    return Fault(int(parts[0]), repr(Action.from_str(parts[1])), parts[2] if len(parts) == 3 else "exit")
