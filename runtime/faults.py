"""Fault-injection hooks for tests: PIPELINE_FAULT="RANK:ACTION[:exit|raise|hang]" and
PARTITIONER_FAULT="KIND:rank=R:step=S[:attempt=A]" ([Note: injected faults]).

Right before ACTION (e.g. `1B0`), rank RANK exits at once (os._exit(13), as if killed),
raises a RuntimeError, or hangs; the other ranks must then fail with a clear message.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from pathlib import Path

from .errors import PipelineError
from .schedule import Action

__all__ = ["Fault", "parse_fault", "StepFault", "StepFaults", "parse_step_faults", "from_env", "set_step", "FAULT_ENV",
           "ATTEMPT_ENV"]

_MODES = ("exit", "raise", "hang")


class Fault:
    """Where and how this process is to fail."""

    def __init__(self, rank: int, action: str, mode: str) -> None:
        self.rank, self.action, self.mode = rank, action, mode

    def check(self, rank: int, action: Action, step: int = 0) -> None:
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


# -- [Note: injected faults] ----------------------------------------------------------------
#
# PARTITIONER_FAULT="KIND:rank=R:step=S[:attempt=A]" (several, comma-separated) makes rank R
# fail at step S of attempt A (default 1; `partitioner run --max-restarts` counts attempts in
# PARTITIONER_ATTEMPT), so that a restarted job does not meet the same fault again:
#   kill      SIGKILL itself mid-step: after its first forward, before its first backward
#   hang      SIGSTOP itself there (its peers' step timeout, PIPELINE_TIMEOUT_S, finds it)
#   save-kill SIGKILL itself during the save after step S (its model files written, not the rest)
#   enospc    its checkpoint writer raises OSError(ENOSPC) during the save after step S
#   corrupt   it flips a byte of a tensor file of the checkpoint saved after step S, once saved

FAULT_ENV, ATTEMPT_ENV = "PARTITIONER_FAULT", "PARTITIONER_ATTEMPT"
_KINDS = ("kill", "hang", "save-kill", "enospc", "corrupt")
_BACKWARD = ("B", "I", "W")
_STEP: list[int] = []  # the training step now, when a training loop says it (`set_step`)


def set_step(step: int) -> None:
    """The training loop's step number (`partitioner run`'s, which goes on after a resume);
    without it a fault's step counts this process's pipeline calls."""
    _STEP[:] = [step]


class StepFault:
    """One injected fault ([Note: injected faults])."""

    def __init__(self, kind: str, rank: int, step: int, attempt: int) -> None:
        self.kind, self.rank, self.step, self.attempt = kind, rank, step, attempt

    def due(self, kinds: tuple[str, ...], rank: int, step: int | None) -> bool:
        """Whether this fault is one of `kinds` and falls now, on this rank at this step and attempt."""
        now = int(os.environ.get(ATTEMPT_ENV, "1") or 1)
        return self.kind in kinds and (self.rank, self.step, self.attempt) == (rank, step, now)

    def say(self, where: str) -> None:
        print(f"{FAULT_ENV}: rank {self.rank} {self.kind} at step {self.step} ({where})", file=sys.stderr, flush=True)


class StepFaults:
    """Every fault PARTITIONER_FAULT asks for; `check` has Fault's signature (runtime/distributed.py calls it)."""

    def __init__(self, faults: list[StepFault], inner: Fault | None = None) -> None:
        self.faults, self.inner = faults, inner

    def check(self, rank: int, action: Action, step: int = 0) -> None:
        """kill / hang before this rank's first backward action of the step."""
        if self.inner is not None:
            self.inner.check(rank, action)
        if action.kind.value not in _BACKWARD:
            return
        for fault in self.faults:
            if fault.due(("kill", "hang"), rank, _STEP[0] if _STEP else step):
                fault.say(f"before {action!r}")
                os.kill(os.getpid(), signal.SIGKILL if fault.kind == "kill" else signal.SIGSTOP)

    def at_save(self, rank: int, step: int | None, where: Path) -> None:
        """save-kill / enospc: called by the checkpoint writer of the save after `step`."""
        for fault in self.faults:
            if fault.due(("save-kill",), rank, step):
                fault.say(f"saving into {where}")
                os.kill(os.getpid(), signal.SIGKILL)
            if fault.due(("enospc",), rank, step):
                fault.say(f"saving into {where}")
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(where))


    def after_save(self, rank: int, step: int | None, path: Path) -> None:
        """corrupt: called once the save after `step` is complete at `path`."""
        for fault in self.faults:
            if fault.due(("corrupt",), rank, step):
                file = sorted(path.rglob("*.distcp"))[0]
                fault.say(f"flipping a byte of {file}")
                data = bytearray(file.read_bytes())
                data[len(data) // 2] ^= 0xFF
                file.write_bytes(bytes(data))


def parse_step_faults(text: str) -> list[StepFault]:
    """The faults of PARTITIONER_FAULT's value; a clear error for a malformed one."""
    return [_parse_one(part) for part in text.split(",") if part.strip()]


def _parse_one(text: str) -> StepFault:
    kind, *fields = text.strip().split(":")
    try:
        values = {k: int(v) for k, v in (f.split("=") for f in fields)}
        assert kind in _KINDS and {"rank", "step"} <= set(values) <= {"rank", "step", "attempt"}
    except (ValueError, AssertionError):
        raise PipelineError(f"{FAULT_ENV}={text!r}: write KIND:rank=R:step=S[:attempt=A] with KIND one of "
                            f"{', '.join(_KINDS)}, e.g. kill:rank=1:step=3.") from None
    return StepFault(kind, values["rank"], values["step"], values.get("attempt", 1))


def from_env() -> StepFaults | Fault | None:
    """The faults PIPELINE_FAULT and PARTITIONER_FAULT ask for, or None (no test hook set)."""
    inner = parse_fault(os.environ.get("PIPELINE_FAULT", ""))
    faults = parse_step_faults(os.environ.get(FAULT_ENV, ""))
    return StepFaults(faults, inner) if faults else inner
