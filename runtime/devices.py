"""Streams: where each stage of a `LocalPipeline` runs (devices, one CUDA stream per
device: `StageStreams`), and the stream a `DistributedPipeline` rank posts its pipeline
messages from (`CommStream`).

On CPU (the default) every method is a no-op pass-through.  With several GPUs
(`device=["cuda:0", "cuda:1", ...]`, torchgpipe-style) the stages of each device compute
on that device's own stream; a value moving from stage a to stage b is copied on b's
stream after b's stream waits on an event recorded on a's stream, and `record_stream`
keeps the source alive until the copy is done.  Each step starts with the stage streams
waiting on the current streams and ends with them synchronized.

[Note: communication stream]
    On CUDA a `DistributedPipeline` rank computes on its current stream and posts its
    pipeline sends and receives (NCCL isend/irecv) from a second stream of its own, so that
    a message never waits on compute it does not need.  ProcessGroupNCCL runs each operation
    on its internal stream after waiting for the stream current when it was posted: posted
    from the compute stream, a receive would wait for every kernel queued before it, and
    the rank (which waits for each receive with a timeout, on the host) would stall until
    the GPU drained.  The rules, which `CommStream` keeps:
      1. A send waits for the compute stream up to the moment it is posted (an event
         recorded there: `wait_stream`); the schedule posts each SEND right after the F or
         B that made its tensor (schedule.lower), so it waits for that tensor and for
         nothing queued later.
      2. A sent tensor was allocated on the compute stream; it stays referenced (the
         pipeline's step keeps it with its work) until `_wait_sends` has waited for the send,
         which orders the compute stream after it: only then may the allocator hand its
         memory to new compute.
      3. A receive buffer is allocated from the communication stream's memory, so no kernel
         still queued on the compute stream can be using that memory when NCCL writes it.
      4. After the receive completes, the compute stream waits for the communication stream
         (an event recorded there) before anything reads the buffer, and
         `record_stream(compute)` keeps the allocator from giving the buffer's memory to a
         later receive while compute may still read it.
    On the CPU (gloo) there is no stream: the calls are the plain ones.  Never run on a GPU
    yet: `benchmarks/gpu_check.py`'s row e (two GPUs) is the check.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch

from .errors import PipelineError

__all__ = ["CommStream", "resolve_devices", "StageStreams"]

DeviceLike = str | torch.device | int


def resolve_devices(device: DeviceLike | Sequence[DeviceLike] | None, ranks: Sequence[int], pp: int) -> list[torch.device]:
    """One device per stage: None -> CPU; one device -> every stage; a list of one device
    per stage -> stage k on device k; a list of `pp` devices -> stage s on the device of its
    pipeline rank `ranks[s]` (s % pp, or a V under zb-v: `schedule.placement`)."""
    num_stages = len(ranks)
    if device is None:
        return [torch.device("cpu")] * num_stages
    if isinstance(device, (str, torch.device, int)):
        return [_device(device)] * num_stages
    devices = [_device(d) for d in device]
    if len(devices) == num_stages:
        return devices
    if len(devices) == pp:
        return [devices[r] for r in ranks]
    raise PipelineError(f"device= lists {len(devices)} devices but the package has {num_stages} stages on {pp} ranks: "
                        f"give one device, one per stage or one per rank.")


def _device(d: DeviceLike) -> torch.device:
    dev = torch.device(f"cuda:{d}" if isinstance(d, int) else d)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise PipelineError(f"device {dev} was asked for but CUDA is not available: leave device= unset to run on CPU.")
    return dev


class StageStreams:
    """A compute stream per CUDA device (stages on one device share it, so their work
    stays in order), and ordered copies between devices."""

    def __init__(self, devices: list[torch.device]) -> None:
        self.devices = devices
        self._by_device: dict[torch.device, Any] = {
            d: torch.cuda.Stream(device=d) for d in dict.fromkeys(devices) if d.type == "cuda"}
        self.streams: list[Any] = [self._by_device.get(d) for d in devices]

    def begin(self) -> None:
        """Order the stage streams after the work already queued on each device's current
        stream (the optimizer's update of the weights, the inputs' copies)."""
        for device, stream in self._by_device.items():
            stream.wait_stream(torch.cuda.current_stream(device))

    @contextlib.contextmanager
    def on(self, stage: int) -> Iterator[None]:
        """Run the enclosed work on `stage`'s stream (nothing to do on CPU)."""
        stream = self.streams[stage]
        if stream is None:
            yield
            return
        with torch.cuda.device(self.devices[stage]), torch.cuda.stream(stream):
            yield

    def move(self, value: Any, src: int | None, dst: int) -> Any:
        """`value` on stage `dst`'s device, ordered after the work of stage `src` (None: the host)."""
        if not isinstance(value, torch.Tensor):
            return value
        target = self.devices[dst]
        if value.device == target:
            return value
        src_stream = self.streams[src] if src is not None else None
        dst_stream = self.streams[dst]
        if dst_stream is None:
            if src_stream is not None:
                src_stream.synchronize()
            return value.to(target)
        with torch.cuda.device(target), torch.cuda.stream(dst_stream):
            if src_stream is not None:
                event = torch.cuda.Event()
                event.record(src_stream)
                dst_stream.wait_event(event)
            moved = value.to(target, non_blocking=True)
            if value.is_cuda:
                value.record_stream(dst_stream)
        return moved

    def synchronize(self) -> None:
        """Wait for every stage stream; later work on the current streams then sees the results."""
        for stream in self._by_device.values():
            stream.synchronize()


class CommStream:
    """The stream a rank posts its pipeline messages from, beside its compute stream
    ([Note: communication stream]); on the CPU nothing but the plain calls."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream: Any = torch.cuda.Stream(device=device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def sending(self) -> Iterator[None]:
        """Post the enclosed send from the communication stream, after the compute stream's
        work so far (rule 1)."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield

    def empty(self, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        """A receive buffer, from the communication stream's memory (rule 3)."""
        if self.stream is None:
            return torch.empty(shape, dtype=dtype, device=self.device)
        with torch.cuda.stream(self.stream):
            return torch.empty(shape, dtype=dtype, device=self.device)

    @contextlib.contextmanager
    def posting(self) -> Iterator[None]:
        """Post the enclosed receive from the communication stream."""
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            yield

    @contextlib.contextmanager
    def receiving(self, buffer: torch.Tensor) -> Iterator[None]:
        """Wait for the enclosed receive into `buffer` on the communication stream; then
        order the compute stream after it and give it the buffer (rule 4)."""
        if self.stream is None:
            yield
            return
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            yield
        compute.wait_stream(self.stream)
        buffer.record_stream(compute)
