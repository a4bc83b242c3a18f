"""One way to time work and count its memory on any device.

A CUDA kernel returns before it has run, so a wall clock around a call times its launch;
a CUDA timer records events on the device's stream around the call and synchronises
before it reads them.  The CPU runs each op to the end before the call returns, so the
same interface reads `time.perf_counter`.  Peak memory is the allocator's own count on
CUDA (`torch.cuda.max_memory_allocated`); the CPU has no such count, so it is None there.

    timer = device_timer(device)
    seconds = timer.time(lambda: stage(x).sum().backward())
    peak = timer.peak_bytes(lambda: stage(x).sum().backward())   # None on the CPU
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["DeviceTimer", "device_timer"]


@dataclass(frozen=True)
class DeviceTimer:
    """Times calls on `device` (see the module's docstring)."""

    device: torch.device

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def time(self, call: Callable[[], Any]) -> float:
        """Seconds `call()` takes on the device, from the moment the device is idle."""
        self.synchronize()
        if not self.is_cuda:
            start = time.perf_counter()
            call()
            return time.perf_counter() - start
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        call()
        end.record()
        end.synchronize()
        return float(begin.elapsed_time(end)) / 1e3

    def median(self, call: Callable[[], Any], samples: int, warmup: int = 2) -> float:
        """The median of `samples` timings of `call()` after `warmup` untimed calls."""
        for _ in range(warmup):
            call()
        times = sorted(self.time(call) for _ in range(max(1, samples)))
        return times[len(times) // 2]

    def peak_bytes(self, call: Callable[[], Any]) -> int | None:
        """The allocator's peak while `call()` runs, above what was allocated before it
        (CUDA); None on the CPU, which keeps no such count."""
        if not self.is_cuda:
            call()
            return None
        self.synchronize()
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        call()
        self.synchronize()
        return int(torch.cuda.max_memory_allocated(self.device) - before)


def device_timer(device: str | torch.device) -> DeviceTimer:
    """The timer for `device` ("cpu", "cuda", "cuda:1", ...)."""
    return DeviceTimer(torch.device(device))
