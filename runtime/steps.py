"""Step safety for `DistributedPipeline`: ranks that fall out of step fail at once, and a
failed step stops every rank until `pipe.recover()`.

[Note: step numbers]
    Every collective call of a pipeline (train_step, evaluate, pipe(...)) is call n on
    every rank, counted by `StepGuard.call`.  A call
      1. counts n and does its rank-local work (splitting the batch: the errors a rank can
         raise alone, a wrong batch on one rank, come here);
      2. checks: an all_gather over the pipeline's own world group of (n, the call that
         failed on this rank or 0), with the pipeline's timeout.  A rank whose last call
         failed, or a rank at another n, makes every rank raise a `StepError` that names
         both numbers, at once (not at a receive's timeout, and never silently pairing one
         step's activations with another's targets);
      3. tags its point-to-point messages with n (p2p.HandOvers.tag), so no message of one
         call can be received as another's.
    A call that raises (here, or later: a peer that failed) marks this rank failed; the
    next call reports it in its check and raises, on every rank, until every rank calls
    `recover()`, which agrees on the highest n and clears the marks.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from .comm import guard, wait
from .errors import PipelineError

__all__ = ["StepError", "StepGuard"]


class StepError(PipelineError):
    """The ranks are out of step, or a rank's step failed: every rank refuses until `pipe.recover()`."""


class StepGuard:
    """This rank's call count and failure mark, checked across the world group ([Note: step numbers])."""

    def __init__(self, group: Any, rank: int, world: int, device: torch.device, timeout_s: float,
                 describe: Callable[[bool, str], str]) -> None:
        self.group, self.rank, self.world, self.device = group, rank, world, device
        self.timeout_s, self.describe = timeout_s, describe
        self.call = 0
        self.failed = 0  # the call that failed on this rank, 0: none

    @contextlib.contextmanager
    def step(self) -> Iterator[int]:
        """Count a call (step 1); any exception inside marks it failed."""
        self.call += 1
        try:
            yield self.call
        except BaseException:
            self.failed = self.failed or self.call
            raise

    def check(self) -> None:
        """Step 2: every rank's (call, failed) agrees, or every rank raises StepError."""
        table = self._gather([self.call, self.failed])
        failed = [(r, f) for r, (_, f) in enumerate(table) if f]
        if failed:
            who = "; ".join(f"rank {r}'s step {f} failed{' (this rank)' if r == self.rank else ''}, it is now at step "
                            f"{table[r][0]}" for r, f in failed)
            raise StepError(f"rank {self.rank} refuses step {self.call}: {who}. Every rank refuses steps until "
                            f"pipe.recover() on every rank (look at the failed rank's own error first; zero the "
                            f"gradients, as the failed step may have left some).")
        other = next(((r, c) for r, (c, _) in enumerate(table) if c != self.call), None)
        if other is not None:
            r, c = other
            raise StepError(f"rank {self.rank} is at step {self.call} but rank {r} is at step {c}: the ranks are out "
                            f"of step (every rank must make the same train_step / evaluate / pipe(...) calls). Call "
                            f"pipe.recover() on every rank.")

    def recover(self) -> None:
        """Every rank: agree on the highest call count, clear the failure marks (collective)."""
        table = self._gather([self.call, 0])
        self.call = max(c for c, _ in table)
        self.failed = 0

    def _gather(self, mine: list[int]) -> list[tuple[int, int]]:
        local = torch.tensor(mine, dtype=torch.int64, device=self.device)
        out = [torch.zeros_like(local) for _ in range(self.world)]
        with guard(self.describe):
            work = dist.all_gather(out, local, group=self.group, async_op=True)
        wait(work, self.timeout_s, self.describe)
        return [(int(t[0]), int(t[1])) for t in out]
