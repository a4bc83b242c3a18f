"""`partitioner run --max-restarts R`: a failed job starts again from its newest complete
checkpoint, up to R times, and says what it survived (docs/checkpoints.md, "Restarts").

[Note: restarts]
    Each attempt is a FRESH torchrun (its own rendezvous port and store): torchrun's own
    --max-restarts re-runs workers on the old store, and with gloo they then fail to connect
    or hang.  Attempt a > 1 runs with --resume-if-any, so every rank loads the newest
    complete checkpoint (model, optimizer, step, RNG; the data goes on from the next step)
    and the finished run equals an uninterrupted one.  The launcher
      - holds a lock on the checkpoint folder (ROOT/.run.lock) for the whole run, so no
        other run writes there, and before each attempt removes the .NAME.partial folders
        of saves that did not finish ([Note: checkpoint commit]): nothing is writing them;
      - gives each attempt a status folder (PARTITIONER_STATUS_DIR) where every rank writes
        its pid and step as it goes, and its error when it stops on one;
      - restarts unless a rank stopped on an error that would happen again (a wrong batch,
        a full disk: anything but PeerError, StepError or a save broken by a peer), and
        otherwise names the failure: torchrun's first failed rank, with its signal or exit
        status and the step its status file says, or that rank's own error;
      - wakes stopped workers (SIGCONT) once a rank has reported an error, so that torchrun's
        SIGTERM reaches a rank that hung by SIGSTOP without its 30-second wait.
    Every rank prints which checkpoint it resumed from and how many restarts are left
    (PARTITIONER_ATTEMPT, PARTITIONER_RESTARTS_LEFT); at the end the launcher lists the
    faults survived (attempt, rank, step, what).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from .checkpoint.commit import clean_partial
from .errors import CheckpointError, PeerError, PipelineError
from .faults import ATTEMPT_ENV
from .steps import StepError

__all__ = ["Failure", "failure", "run_attempts", "report_step", "report_error", "is_fault", "announce_resume", "LEFT_ENV",
           "STATUS_ENV", "LOCK"]

LEFT_ENV, STATUS_ENV, LOCK = "PARTITIONER_RESTARTS_LEFT", "PARTITIONER_STATUS_DIR", ".run.lock"


# -- on each rank -----------------------------------------------------------------------------


def _write_status(rank: int, status: dict[str, Any]) -> None:
    folder = os.environ.get(STATUS_ENV)
    if not folder:
        return
    tmp = Path(folder) / f".rank-{rank}.tmp"
    tmp.write_text(json.dumps({"pid": os.getpid(), **status}))
    os.replace(tmp, Path(folder) / f"rank-{rank}.json")


def report_step(rank: int, step: int) -> None:
    """This rank begins `step` (its status file; nothing outside `run --max-restarts`)."""
    _write_status(rank, {"step": step})


def is_fault(exc: BaseException) -> bool:
    """Whether `exc` is a peer's failure, which a restart gets past ([Note: restarts])."""
    if isinstance(exc, (PeerError, StepError)):
        return True
    cause = exc.__cause__
    return type(exc) is CheckpointError and cause is not None and not isinstance(cause, PipelineError)


def report_error(rank: int, step: int, exc: BaseException) -> None:
    """This rank stops at `step` on `exc` (its status file)."""
    _write_status(rank, {"step": step, "error": str(exc), "fault": is_fault(exc)})


def announce_resume(rank: int, path: Path | None, step: int) -> None:
    """After a restart, one line per rank: the checkpoint it resumed from and the restarts left."""
    attempt = int(os.environ.get(ATTEMPT_ENV, "1") or 1)
    if attempt > 1:
        whence = f"resumed from {path} after step {step}" if path else "found no complete checkpoint: started afresh"
        print(f"rank {rank}: attempt {attempt}: {whence}; {os.environ.get(LEFT_ENV, '?')} restarts left", flush=True)


# -- the launcher -------------------------------------------------------------------------------


@dataclass
class Failure:
    """One failed attempt: which rank, at which step, what happened, and whether to restart."""

    attempt: int
    rank: int | None
    step: int | None
    what: str
    retry: bool = True

    def __str__(self) -> str:
        rank = f"rank {self.rank}" if self.rank is not None else "a rank"
        step = f" at step {self.step}" if self.step is not None else ""
        return f"attempt {self.attempt}: {rank}{step}: {self.what}"


def _statuses(folder: Path) -> dict[int, dict[str, Any]]:
    out = {}
    for file in folder.glob("rank-*.json"):
        try:
            out[int(file.stem.split("-")[1])] = json.loads(file.read_text())
        except (ValueError, OSError):
            continue
    return out


_EXIT = re.compile(r"rank\s*:\s*(\d+).*\n\s*exitcode\s*:\s*(-?\d+)")


def _exits(output: str) -> tuple[dict[int, int], tuple[int, int] | None]:
    """torchrun's failed ranks with their exit codes (negative: the signal), and its root cause."""
    cause = output.rpartition("Root Cause")[2] if "Root Cause" in output else ""
    first = _EXIT.search(cause)
    return {int(r): int(c) for r, c in _EXIT.findall(output)}, ((int(first[1]), int(first[2])) if first else None)


def _what(code: int | None) -> str:
    if code is not None and code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else "?"
        return f"killed by signal {-code} ({name})"
    return f"exited with status {code}" if code is not None else "stopped"


def failure(attempt: int, statuses: dict[int, dict[str, Any]], output: str) -> Failure:
    """What failed in one attempt ([Note: restarts])."""
    errors = {r: s for r, s in statuses.items() if "error" in s}
    user = [r for r, s in errors.items() if not s["fault"]]
    if user:
        return Failure(attempt, user[0], errors[user[0]].get("step"), errors[user[0]]["error"], retry=False)
    exits, cause = _exits(output)
    rank, code = cause if cause else (None, None)
    # a rank killed by a signal (not torchrun's SIGTERM) and silent beats a peer that reported it
    killed = [r for r, c in sorted(exits.items()) if c < 0 and c != -signal.SIGTERM and r not in errors]
    if killed and (rank is None or rank in errors):
        rank, code = killed[0], exits[killed[0]]
    if rank is None and errors:
        rank = min(errors)
    state = statuses.get(rank, {}) if rank is not None else {}
    what = state["error"] if "error" in state else _what(code)
    return Failure(attempt, rank, state.get("step"), what)


def _wake(folder: Path, proc: subprocess.Popen[str]) -> None:
    """Once a rank reported an error, SIGCONT every rank of the attempt until torchrun ends."""
    while proc.poll() is None:
        statuses = _statuses(folder)
        if any("error" in s for s in statuses.values()):
            for s in statuses.values():
                try:
                    os.kill(int(s["pid"]), signal.SIGCONT)
                except (OSError, KeyError, ValueError):
                    pass
        time.sleep(0.2)


def _attempt(cmd: list[str], env: dict[str, str], folder: Path) -> tuple[int, str]:
    """Run one torchrun, its stderr passed through (and kept: the last 400 lines)."""
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    waker = threading.Thread(target=_wake, args=(folder, proc), daemon=True)
    waker.start()
    kept: list[str] = []
    assert proc.stderr is not None
    try:
        for line in proc.stderr:
            sys.stderr.write(line)
            kept = (kept + [line])[-400:]
    finally:  # Ctrl-C reaches torchrun too: wait for it to end its workers
        rc = proc.wait()
    waker.join()
    return rc, "".join(kept)


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """Hold ROOT/.run.lock, or refuse: another run is using the checkpoint folder."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / LOCK, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise CheckpointError(f"checkpoint folder {root} is in use by another `partitioner run` (it holds "
                                  f"{root / LOCK}): wait for it to end, or give this run its own --checkpoint "
                                  f"folder.") from None
        yield


def run_attempts(command: Callable[[int], list[str]], env: dict[str, str], restarts: int, root: Path) -> int:
    """Run `command(attempt)` until it succeeds, at most 1 + `restarts` times ([Note: restarts]);
    0 when it did, else 1."""
    survived: list[Failure] = []
    with _locked(root):
        for attempt in range(1, restarts + 2):
            for path in clean_partial(root):
                print(f"partitioner run: removed {path}, a checkpoint whose save did not finish", file=sys.stderr)
            with tempfile.TemporaryDirectory(prefix="partitioner-status-") as folder:
                more = {ATTEMPT_ENV: str(attempt), LEFT_ENV: str(restarts - attempt + 1), STATUS_ENV: folder}
                rc, output = _attempt(command(attempt), {**env, **more}, Path(folder))
                if rc == 0:
                    _summary(survived)
                    return 0
                failed = failure(attempt, _statuses(Path(folder)), output)
            if not failed.retry or attempt > restarts:
                _give_up(failed, survived, restarts)
                return 1
            survived.append(failed)
            print(f"partitioner run: {failed}; restarting from the newest complete checkpoint under {root} "
                  f"({restarts - attempt} restarts left after this one)", file=sys.stderr, flush=True)
    return 1


def _summary(survived: list[Failure]) -> None:
    if survived:
        lines = "".join(f"\n  {f}" for f in survived)
        print(f"partitioner run: finished after {len(survived)} fault(s) survived:{lines}", file=sys.stderr)


def _give_up(failed: Failure, survived: list[Failure], restarts: int) -> None:
    why = ("not restarted: that error would happen again" if not failed.retry
           else f"no restarts left (--max-restarts {restarts})")
    before = "".join(f"\n  survived {f}" for f in survived)
    print(f"partitioner run: {failed}\n  {why}{before}", file=sys.stderr, flush=True)
