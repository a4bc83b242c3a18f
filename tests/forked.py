"""A test's body run in a forked child, so that a crash (a signal: a kernel's SIGSEGV)
fails that test instead of ending the whole session.  The child computes on one intra-op
thread: one forked from a process whose OpenMP ran several threads hangs at its first
parallel region (GNU libgomp)."""

from __future__ import annotations

import multiprocessing
import pickle
import signal
import traceback
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def forked(body: Callable[[], T], timeout_s: float = 300.0) -> T:
    """`body()` in a forked child: its result (which must pickle); an AssertionError that
    names the signal where the child died, or carries the child's traceback where it raised."""
    ctx = multiprocessing.get_context("fork")
    mine, theirs = ctx.Pipe(duplex=False)

    def run() -> None:  # plain pickles: torch's shared-memory ones would outlive their process
        torch.set_num_threads(1)
        try:
            theirs.send_bytes(pickle.dumps(("ok", body())))
        except BaseException:
            theirs.send_bytes(pickle.dumps(("error", traceback.format_exc())))

    child = ctx.Process(target=run)
    child.start()
    theirs.close()
    try:
        assert mine.poll(timeout_s), f"the child did not answer in {timeout_s:g} s"
        try:
            kind, payload = pickle.loads(mine.recv_bytes())
        except EOFError:
            child.join()
            code = child.exitcode or 0
            raise AssertionError(f"the child died ({signal.Signals(-code).name if code < 0 else f'exit status {code}'})"
                                 ) from None
    finally:
        mine.close()
        child.join(5)
        if child.is_alive():
            child.kill()
            child.join()
    assert kind == "ok", f"the child raised:\n{payload}"
    return payload
