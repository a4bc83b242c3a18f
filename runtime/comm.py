"""torch.distributed plumbing for `DistributedPipeline`: start-up, process groups, waits
with timeouts, data-parallel gradient buckets, tied-parameter gradient sums.

[Note: process groups]
    Global rank = (replica * pp + position) * tp + t ([Note: rank layout]).  Every rank creates
    every group, in the same order (dist.new_group is collective):
      1. one group per stage edge (p, c) across positions, per replica and tp index t:
         activations of p go to c and gradients come back on it, in microbatch order, so
         it is first-in first-out as NCCL needs (see [Note: schedule semantics] in
         schedule/validation.py); tp rank t of p talks to tp rank t of c only;
      2. one data-parallel group per pipeline position and t (the dp replicas of its
         shards);
      3. one group per tied parameter whose copies sit on several positions, and t (every
         rank holding that shard of a copy, all replicas);
      4. when tp > 1, one tensor-parallel group per replica and position (its tp
         neighbours): the stage code's tp.* collectives run on it (tp.py);
      5. one group of every rank, the pipeline's own: the loss, clipping and the step
         check run on it, never on the default group, whose collectives are the user's.
    With tp == 1 there are no groups 4 and groups 1-3 are made in the order they always were.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import re
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from .affinity import bind_local_rank
from .malloc import keep_freed_memory
from .errors import MeshError, PeerError, PipelineError

__all__ = ["init_from_env", "timeout_from_env", "guard", "wait", "GradBuckets", "TiedGrads", "BUCKET_BYTES"]

BUCKET_BYTES = 25 * 1024 * 1024
DEFAULT_TIMEOUT_S = 60.0


def timeout_from_env(timeout_s: float | None = None) -> float:
    """`timeout_s`, else env PIPELINE_TIMEOUT_S, else 60 seconds."""
    if timeout_s is not None:
        return float(timeout_s)
    text = os.environ.get("PIPELINE_TIMEOUT_S", "")
    try:
        return float(text) if text else DEFAULT_TIMEOUT_S
    except ValueError:
        raise MeshError(f"PIPELINE_TIMEOUT_S={text!r} is not a number of seconds: set it to e.g. 60.") from None


def init_from_env(timeout_s: float) -> torch.device:
    """Start torch.distributed from torchrun's environment unless someone already has
    (gloo on CPU, nccl with CUDA); return this rank's device.  A CPU rank is bound to
    cores of its own ([Note: binding CPU ranks to cores] in affinity.py) and keeps the
    memory it frees for its next step ([Note: keeping freed memory] in malloc.py).  A
    process group started here is also closed here, at the interpreter's exit unless the
    caller closed it first: left to the interpreter's teardown, gloo's threads were
    sometimes destroyed still running and the rank aborted after training ("terminate
    called without an active exception")."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise MeshError(f"DistributedPipeline needs torch.distributed, but {', '.join(missing)} is not set: launch "
                            f"one process per rank with torchrun (`python -m partitioner run DIR --nproc N`).")
        try:
            dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
        except Exception as exc:
            raise MeshError(f"rank {os.environ['RANK']} could not join the process group within {timeout_s:g} s "
                            f"({type(exc).__name__}: {_short(exc)}): start every rank, or raise PIPELINE_TIMEOUT_S.") from None
        atexit.register(_close_process_group)
    backend = dist.get_backend()
    if cuda and backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    bind_local_rank(local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())))
    keep_freed_memory()
    return torch.device("cpu")


def _close_process_group() -> None:
    """Close the default process group if it is still open (at exit: `init_from_env`)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _short(exc: BaseException) -> str:
    """The first sentence of an error, without gloo's `[file.cc:123] ` prefix."""
    lines = str(exc).strip().splitlines()
    text = re.sub(r"^\[[^\]]*\]\s*", "", lines[0]) if lines else type(exc).__name__
    return text.split(". ")[0][:200]


@contextlib.contextmanager
def guard(doing: Callable[[bool, str], str]) -> Iterator[None]:
    """Turn a failure to post a send, receive or collective into PeerError(doing(...))."""
    try:
        yield
    except PipelineError:
        raise
    except Exception as exc:
        reason = _short(exc)
        raise PeerError(doing("timed out" in reason.lower(), reason)) from None


def wait(work: Any, timeout_s: float, doing: Callable[[bool, str], str]) -> None:
    """Wait for `work`, at most `timeout_s`; on failure raise PeerError(doing(timed_out, reason))."""
    try:
        ok = work.wait(timeout=timedelta(seconds=timeout_s))
    except Exception as exc:
        reason = _short(exc)
        raise PeerError(doing("timed out" in reason.lower() or "timeout" in reason.lower(), reason)) from None
    if ok is False:
        raise PeerError(doing(True, f"no answer in {timeout_s:g} s"))


@dataclass
class _Bucket:
    params: list[torch.nn.Parameter]
    ready: set[int] = field(default_factory=set)
    work: Any = None
    flat: torch.Tensor | None = None
    sent: list[torch.nn.Parameter] = field(default_factory=list)


class GradBuckets:
    """Average gradients over a data-parallel group in ~25 MB buckets, each all-reduced
    asynchronously as soon as its last gradient is final (overlapping the backward).

    `arm(params)` right before the last backward that touches them this step: their
    post-accumulate-grad hooks then mark them final.  `finish()` launches what is left,
    waits, and writes the averages back into `.grad`.  Launch order is the autograd order,
    identical on every replica, so the collectives match.
    """

    def __init__(self, params: list[torch.nn.Parameter], group: Any, replicas: int, timeout_s: float,
                 describe: Callable[[bool, str], str], bucket_bytes: int = BUCKET_BYTES) -> None:
        self.group, self.replicas, self.timeout_s, self.describe = group, replicas, timeout_s, describe
        self.buckets: list[_Bucket] = []
        self._of: dict[int, _Bucket] = {}
        self._armed: set[int] = set()
        size = 0
        for p in reversed(params):  # roughly the order backward produces them
            last = self.buckets[-1] if self.buckets else None
            if last is None or size >= bucket_bytes or last.params[0].dtype != p.dtype or last.params[0].device != p.device:
                last, size = _Bucket([]), 0
                self.buckets.append(last)
            last.params.append(p)
            size += p.numel() * p.element_size()
            self._of[id(p)] = last
            p.register_post_accumulate_grad_hook(self._hook)

    def reset(self) -> None:
        """Forget a step that failed half-way (nothing armed, nothing in flight)."""
        self._armed.clear()
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.work, bucket.flat, bucket.sent = None, None, []

    def arm(self, params: list[torch.nn.Parameter]) -> None:
        self._armed.update(id(p) for p in params if id(p) in self._of)

    def _hook(self, p: torch.Tensor) -> None:
        if id(p) not in self._armed:
            return
        self._armed.discard(id(p))
        bucket = self._of[id(p)]
        bucket.ready.add(id(p))
        if len(bucket.ready) == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        bucket.sent = [p for p in bucket.params if p.grad is not None]
        if bucket.sent:
            bucket.flat = torch.cat([p.grad.detach().reshape(-1) for p in bucket.sent])  # type: ignore[union-attr]
            with guard(self.describe):
                bucket.work = dist.all_reduce(bucket.flat, group=self.group, async_op=True)

    def finish(self) -> None:
        """Launch the buckets not yet launched, wait for all, write the averages back."""
        for bucket in self.buckets:
            if bucket.work is None:
                self._launch(bucket)
        for bucket in self.buckets:
            if bucket.work is not None:
                wait(bucket.work, self.timeout_s, self.describe)
                assert bucket.flat is not None
                bucket.flat.div_(self.replicas)
                offset = 0
                for p in bucket.sent:
                    n = p.numel()
                    p.grad.copy_(bucket.flat[offset:offset + n].view_as(p))  # type: ignore[union-attr]
                    offset += n
        self.reset()


class TiedGrads:
    """Copies of a tied parameter on several ranks end each step with the same grad:
    old + (sum over copies and replicas of this step's contribution) / replicas."""

    def __init__(self, entries: list[tuple[torch.nn.Parameter, Any, str]], replicas: int, timeout_s: float,
                 describe: Callable[[str, bool, str], str]) -> None:
        self.entries, self.replicas, self.timeout_s, self.describe = entries, replicas, timeout_s, describe

    def snapshot(self) -> list[torch.Tensor | None]:
        return [None if p.grad is None else p.grad.detach().clone() for p, _, _ in self.entries]

    def reduce(self, snapshot: list[torch.Tensor | None]) -> None:
        works = []
        for (p, group, name), old in zip(self.entries, snapshot):
            if p.grad is None:
                delta = torch.zeros_like(p)
            else:
                delta = p.grad.detach() - old if old is not None else p.grad.detach().clone()
            doing = functools.partial(self.describe, name)
            with guard(doing):
                works.append((dist.all_reduce(delta, group=group, async_op=True), delta, p, old, doing))
        for work, delta, p, old, doing in works:
            wait(work, self.timeout_s, doing)
            delta.div_(self.replicas)
            p.grad = delta if old is None else old + delta
