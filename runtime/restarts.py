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
        SIGTERM reaches a rank that hung by SIGSTOP without its 30-second wait;
      - blames a hang on the rank that stopped, not on the peer whose wait timed out first
        ([Note: heartbeats]).
    Every rank prints which checkpoint it resumed from and how many restarts are left
    (PARTITIONER_ATTEMPT, PARTITIONER_RESTARTS_LEFT); at the end the launcher lists the
    faults survived (attempt, rank, step, what).

[Note: heartbeats]
    A hung rank is found by its peers' timed waits, so the first rank to report an error
    is a waiting one.  Every rank touches rank-R.beat in the status folder every BEAT_S
    from a thread of its own, which stops only when the whole process does (SIGSTOP, a
    crash, or the GIL held in C).  torchrun's wrapper (runtime/_torchrun.py) watches the
    folder: when the first error appears it notes the ranks whose beat is older than
    `stale_after()` (stalled.json), then wakes every rank; `failure` blames the longest
    stalled rank, ahead of the peer that timed out (a woken rank's own error, its peer
    gone, comes after and changes nothing; a killed rank or a rank's own error still
    comes first).  A rank that spins in Python keeps beating and is not told from a
    waiting one.
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

__all__ = ["Failure", "failure", "records", "run_attempts", "report_step", "report_error", "is_fault", "announce_resume",
           "LEFT_ENV", "STATUS_ENV", "LOCK", "start_heartbeat", "watch", "tell", "BEAT_S", "stale_after"]

LEFT_ENV, STATUS_ENV, LOCK = "PARTITIONER_RESTARTS_LEFT", "PARTITIONER_STATUS_DIR", ".run.lock"
BEAT_S = 0.5  # a rank's heartbeat period ([Note: heartbeats])
_STALLED, _EXITS = "stalled.json", "exits.json"  # the wrapper's records in the status folder


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


def report_error(rank: int, step: int, exc: BaseException) -> bool:
    """This rank stops at `step` on `exc` (its status file); whether the launcher will
    print it (a status folder is set), else the rank prints it itself."""
    _write_status(rank, {"step": step, "error": str(exc), "fault": is_fault(exc), "at": time.time()})
    return bool(os.environ.get(STATUS_ENV))


def start_heartbeat(rank: int) -> None:
    """Touch rank-R.beat every BEAT_S from a daemon thread ([Note: heartbeats]); nothing
    without a status folder."""
    folder = os.environ.get(STATUS_ENV)
    if not folder:
        return
    beat = Path(folder) / f"rank-{rank}.beat"

    def run() -> None:
        while True:
            with contextlib.suppress(OSError):
                beat.touch()
            time.sleep(BEAT_S)

    threading.Thread(target=run, name="partitioner-heartbeat", daemon=True).start()


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
        return f"attempt {self.attempt}: {self.where()}"

    def where(self) -> str:
        """The failure without its attempt: rank, step, what."""
        rank = f"rank {self.rank}" if self.rank is not None else "a rank"
        step = f" at step {self.step}" if self.step is not None else ""
        return f"{rank}{step}: {self.what}"


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


def failure(attempt: int, statuses: dict[int, dict[str, Any]], output: str,
            record: dict[str, Any] | None = None) -> Failure:
    """What failed in one attempt ([Note: restarts]); `record`: the wrapper's (`records`),
    else torchrun's failed ranks are read from its `output`."""
    errors = {r: s for r, s in statuses.items() if "error" in s}
    user = [r for r, s in errors.items() if not s["fault"]]
    if user:
        return Failure(attempt, user[0], errors[user[0]].get("step"), errors[user[0]]["error"], retry=False)
    exits, cause = (record["exits"], record["first"]) if record and "exits" in record else _exits(output)
    rank, code = cause if cause else (None, None)
    # a rank killed by a signal (not torchrun's SIGTERM) and silent beats a peer that reported it
    killed = [r for r, c in sorted(exits.items()) if c < 0 and c != -signal.SIGTERM and r not in errors]
    hung = _hung(attempt, statuses, (record or {}).get("stalled", {}))
    if killed and (rank is None or rank in errors):
        rank, code = killed[0], exits[killed[0]]
    elif hung is not None:
        return hung
    if rank is None and errors:
        rank = min(errors)
    state = statuses.get(rank, {}) if rank is not None else {}
    what = state["error"] if "error" in state else _what(code)
    return Failure(attempt, rank, state.get("step"), what)


def _hung(attempt: int, statuses: dict[int, dict[str, Any]], stalled: dict[int, float]) -> Failure | None:
    """The rank whose heartbeat stopped longest ago, when a rank still beating reported an
    error, which came from waiting on it ([Note: heartbeats]); else None."""
    waiting = [r for r, s in statuses.items() if "error" in s and r not in stalled]
    if not stalled or not waiting:
        return None
    rank = max(sorted(stalled), key=lambda r: stalled[r])
    first = min(waiting, key=lambda r: (statuses[r].get("at", 0.0), r))
    return Failure(attempt, rank, statuses.get(rank, {}).get("step"),
                   f"stopped making progress (no heartbeat for {stalled[rank]:.0f} s); rank {first}'s error came "
                   f"from waiting on it")


def stale_after() -> float:
    """How old a heartbeat is when a rank is taken for stalled: half the peers' wait
    (PIPELINE_TIMEOUT_S), within 2-10 s ([Note: heartbeats])."""
    try:
        timeout = float(os.environ.get("PIPELINE_TIMEOUT_S", "60"))
    except ValueError:
        timeout = 60.0
    return min(10.0, max(2.0, timeout / 2))


def watch(folder: Path, done: threading.Event) -> None:
    """Until `done`: once a rank reported an error, note the stalled ranks once (stalled.json)
    and SIGCONT every rank ([Note: heartbeats], [Note: restarts])."""
    noted = False
    while not done.wait(0.2):
        statuses = _statuses(folder)
        if not any("error" in s for s in statuses.values()):
            continue
        if not noted:
            now, stale = time.time(), stale_after()
            ages = {r: now - b.stat().st_mtime for r, b in _beats(folder).items()}
            _write_record(folder, _STALLED, {str(r): a for r, a in ages.items() if a > stale})
            noted = True
        for s in statuses.values():
            try:
                os.kill(int(s["pid"]), signal.SIGCONT)
            except (OSError, KeyError, ValueError):
                pass


def _beats(folder: Path) -> dict[int, Path]:
    out = {}
    for file in folder.glob("rank-*.beat"):
        with contextlib.suppress(ValueError):
            out[int(file.stem.split("-")[1])] = file
    return out


def _write_record(folder: Path, name: str, value: Any) -> None:
    tmp = folder / f".{name}.tmp"
    tmp.write_text(json.dumps(value))
    os.replace(tmp, folder / name)


def records(folder: Path) -> dict[str, Any]:
    """The wrapper's records of an attempt: "exits" {rank: exit code}, "first" (rank, code)
    and "stalled" {rank: heartbeat age}, each where written."""
    out: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        out["stalled"] = {int(r): a for r, a in json.loads((folder / _STALLED).read_text()).items()}
    with contextlib.suppress(OSError, ValueError):
        exits = json.loads((folder / _EXITS).read_text())
        out["exits"] = {int(r): c for r, c in exits["exits"].items()}
        out["first"] = tuple(exits["first"]) if exits["first"] else None
    return out


def tell(folder: Path | None, exits: dict[int, int], first: tuple[int, int] | None) -> None:
    """torchrun's wrapper, once every rank has ended: each rank's error once (the ranks of
    one message together; peers' failures first, a rank's own error last), and, outside
    --max-restarts (whose launcher says it), the failure where it names a rank that said
    nothing: a rank killed, or hung ([Note: restarts])."""
    if folder is None:
        rank, code = first if first else (None, None)
        print(f"partitioner run: {Failure(1, rank, None, _what(code)).where()}", file=sys.stderr, flush=True)
        return
    _write_record(folder, _EXITS, {"exits": {str(r): c for r, c in exits.items()}, "first": first})
    statuses, stalled = _statuses(folder), records(folder).get("stalled", {})
    said: dict[tuple[bool, str], list[int]] = {}
    for rank, s in sorted(statuses.items()):
        if "error" in s and not (s["fault"] and rank in stalled):  # a hung rank woken only to end: its peer is gone
            said.setdefault((not s["fault"], s["error"]), []).append(rank)
    for (_, message), ranks in sorted(said.items(), key=lambda item: item[0][0]):
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        print(f"{who}: error: {message}", file=sys.stderr, flush=True)
    failed = failure(1, statuses, "", records(folder))
    if LEFT_ENV not in os.environ and all(failed.rank not in ranks for ranks in said.values()):
        print(f"partitioner run: {failed.where()}", file=sys.stderr, flush=True)


def _attempt(cmd: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Run one torchrun, its stderr passed through (and kept: the last 400 lines)."""
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    kept: list[str] = []
    assert proc.stderr is not None
    try:
        for line in proc.stderr:
            sys.stderr.write(line)
            kept = (kept + [line])[-400:]
    finally:  # Ctrl-C reaches torchrun too: wait for it to end its workers
        rc = proc.wait()
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
                rc, output = _attempt(command(attempt), {**env, **more})
                if rc == 0:
                    _summary(survived)
                    return 0
                failed = failure(attempt, _statuses(Path(folder)), output, records(Path(folder)))
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
