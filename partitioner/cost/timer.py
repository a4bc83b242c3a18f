"""One way to time work and count its memory on any device: the compile's every measurement
(node costs, the whole graph's and each stage's calibration, the loss) goes through it.

One interface, two implementations.  A CUDA kernel returns before it has run, so a wall
clock around a call times its launch: `CudaTimer` records events on the device's stream
around the call and synchronises before it reads them, and counts memory with the
allocator's own peak (`torch.cuda.max_memory_allocated`).  The CPU runs each op to the end
before the call returns, so `CpuTimer` reads `time.perf_counter`; the CPU keeps no count of
its allocations, so its peak is None (the compile then counts activations by the tensors
autograd saves, as it does on every device: `profile._flops_and_saved`).

    timer = device_timer(device)
    seconds = timer.time(lambda: stage(x).sum().backward())
    peak = timer.peak_bytes(lambda: stage(x).sum().backward())   # None on the CPU
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, TypeVar

import torch

__all__ = ["CPU_TIMER", "CpuTimer", "CudaTimer", "DeviceTimer", "device_timer"]

T = TypeVar("T")


@dataclass(frozen=True)
class DeviceTimer:
    """Times calls on `device` (see the module's docstring); a subclass says how."""

    device: torch.device

    #: whether the device runs work asynchronously, after the call returns (CUDA)
    is_cuda: ClassVar[bool] = False
    #: whether `peak_bytes` counts anything (else it runs the call and says None)
    counts_memory: ClassVar[bool] = False

    @property
    def key(self) -> str:
        """What the measurements depend on besides the work (the device, and on CUDA its
        model): part of every measured cost's cache key."""
        return self.device.type

    def synchronize(self) -> None:
        """Wait until the device has run the work queued so far."""

    def timed(self, call: Callable[[], T]) -> tuple[float, T]:
        """Seconds `call()` takes on the device from the moment it is idle, and what it returned."""
        raise NotImplementedError

    def time(self, call: Callable[[], Any]) -> float:
        """Seconds `call()` takes on the device from the moment it is idle."""
        return self.timed(call)[0]

    def median(self, call: Callable[[], Any], samples: int, warmup: int = 2) -> float:
        """The median of `samples` timings of `call()` after `warmup` untimed calls."""
        for _ in range(warmup):
            call()
        times = sorted(self.time(call) for _ in range(max(1, samples)))
        return times[len(times) // 2]

    def peak_bytes(self, call: Callable[[], Any]) -> int | None:
        """The allocator's peak while `call()` runs, above what was allocated before it;
        None where the device keeps no such count (`call` still runs)."""
        call()
        return None


class CpuTimer(DeviceTimer):
    """The CPU: `call()` has done its work when it returns."""

    def timed(self, call: Callable[[], T]) -> tuple[float, T]:
        start = time.perf_counter()
        out = call()
        return time.perf_counter() - start, out


class CudaTimer(DeviceTimer):
    """A CUDA device: events on its current stream around the call, read once they have run."""

    is_cuda: ClassVar[bool] = True
    counts_memory: ClassVar[bool] = True

    @property
    def key(self) -> str:
        return f"cuda {torch.cuda.get_device_name(self.device)}"

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def timed(self, call: Callable[[], T]) -> tuple[float, T]:
        self.synchronize()
        stream = torch.cuda.current_stream(self.device)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record(stream)
        out = call()
        end.record(stream)
        end.synchronize()
        return float(begin.elapsed_time(end)) / 1e3, out

    def peak_bytes(self, call: Callable[[], Any]) -> int | None:
        self.synchronize()
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        call()
        self.synchronize()
        return int(torch.cuda.max_memory_allocated(self.device) - before)


def device_timer(device: str | torch.device) -> DeviceTimer:
    """The timer for `device` ("cpu", "cuda", "cuda:1", ...)."""
    device = torch.device(device)
    return CudaTimer(device) if device.type == "cuda" else CpuTimer(device)


#: what the cost functions time with unless told otherwise (their callers on a GPU pass its timer)
CPU_TIMER = device_timer("cpu")
