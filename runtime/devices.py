"""Where each stage of a `LocalPipeline` runs: devices, one CUDA stream per stage.

On CPU (the default) every method is a no-op pass-through.  With several GPUs
(`device=["cuda:0", "cuda:1", ...]`, torchgpipe-style) the stages of each device compute
on that device's own stream; a value moving from stage a to stage b is copied on b's
stream after b's stream waits on an event recorded on a's stream, and `record_stream`
keeps the source alive until the copy is done.  Each step starts with the stage streams
waiting on the current streams and ends with them synchronized.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch

from .errors import PipelineError

__all__ = ["resolve_devices", "StageStreams"]

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
