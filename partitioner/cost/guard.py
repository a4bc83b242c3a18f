"""Work that may crash the process, run where a crash costs only that piece of it.

[Note: a profiled op that crashes]
    Profiling runs each node's op forward and backward in isolation, backward in parts
    (the input's and the weights' gradients apart, for zero-bubble schedules), which no
    training step asks of some kernels: torch's CPU group norm dies by SIGSEGV when asked
    for the weights' gradients alone on a channels_last input (now asked as the runtime
    asks it: [Note: a weight-only group norm backward] in runtime/split_backward.py), and
    kernels yet unknown may.  A crash there must not end the compile.  So on the CPU the profiling pass runs in one forked child (`guarded`),
    which hands each node's timings back as it has them; where the child dies, the node
    it was on gets its analytic (roofline) cost, the compile says so in one line, and a
    new child goes on from the next node.  One fork per pass (copy-on-write: nothing is
    copied but the page tables), so the usual path costs what it did.  The child computes
    on one intra-op thread, as the compile profiles (`measure.rank_threads`): a child forked
    from a process whose OpenMP ran several threads hangs at its first parallel region
    (GNU libgomp).  So where torch runs on more threads, the pass runs in the process, as
    it does on a GPU (CUDA cannot be used after a fork), where the platform cannot fork,
    or where the process may not have children (a daemon).
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import pickle
import signal
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Generator, TypeVar

__all__ = ["Crashed", "can_guard", "guarded"]

R = TypeVar("R")


@dataclass(frozen=True)
class Crashed:
    """What `guarded` yields for an item whose work ended the child: `how`, in words
    ("SIGSEGV", "exit status 3")."""

    how: str


def can_guard() -> bool:
    """Whether work can run in a forked child here."""
    return ("fork" in multiprocessing.get_all_start_methods() and hasattr(os, "fork")
            and not multiprocessing.current_process().daemon)


def guarded(count: int, work: Callable[[int], R]) -> Generator[R | Crashed, None, None]:
    """`work(i)` for i in range(count), in order, run in a forked child: each result as the
    child hands it back, or `Crashed` for the item the child died on, after which a new
    child goes on from the next one ([Note: a profiled op that crashes]).  An exception
    `work` raises is raised here, with the child's traceback as a note.  Results must pickle."""
    ctx = multiprocessing.get_context("fork")
    start = 0
    while start < count:
        mine, theirs = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_child, args=(theirs, work, start, count), daemon=True)
        child.start()
        theirs.close()
        try:
            for i in range(start, count):
                try:
                    kind, payload = pickle.loads(mine.recv_bytes())
                except (EOFError, OSError):  # the child died on item i
                    child.join()
                    yield Crashed(_how(child.exitcode))
                    break
                if kind == "error":
                    raise payload
                yield payload
        finally:
            mine.close()
            _stop(child)
        start = i + 1


def _child(conn: Any, work: Callable[[int], Any], start: int, count: int) -> None:
    """In the forked child: each item's result down `conn`, or the exception that stopped it."""
    _quiet_crash()
    try:
        for i in range(start, count):
            conn.send_bytes(pickle.dumps(("ok", work(i))))  # plain pickles: no shared memory to outlive the child
    except BaseException as exc:  # handed to the parent, which raises it
        conn.send_bytes(pickle.dumps(("error", _portable(exc))))
    finally:
        conn.close()


def _portable(exc: BaseException) -> BaseException:
    """`exc` with the child's traceback as a note, or a RuntimeError saying it where `exc`
    does not survive pickling."""
    text = "".join(traceback.format_exception(exc))
    try:
        exc.add_note(f"(raised while profiling, in the forked child:)\n{text}")
        back = pickle.loads(pickle.dumps(exc))
        return back if isinstance(back, BaseException) else RuntimeError(text)
    except Exception:
        return RuntimeError(text)


def _quiet_crash() -> None:
    """A crash in the child leaves no core file in the user's folder, and no dump of its
    threads on stderr (where faulthandler is on): the parent says what happened."""
    faulthandler.disable()
    try:
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_CORE)
        resource.setrlimit(resource.RLIMIT_CORE, (0, hard))
    except (ImportError, ValueError, OSError):
        pass


def _how(exitcode: int | None) -> str:
    """How a child ended, in words."""
    if exitcode is None:
        return "an unknown cause"
    if exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit status {exitcode}"


def _stop(child: Any) -> None:
    """The child ended and reaped: at once where it is done, killed where the parent left
    early (an exception, a generator closed)."""
    child.join(0.5)
    if child.is_alive():
        child.kill()
        child.join()
