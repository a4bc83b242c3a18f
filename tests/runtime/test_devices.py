"""The communication stream (runtime/devices.py, [Note: communication stream]): the plain
calls on the CPU, and on CUDA the order of its waits, with CUDA's streams faked (the real
ones run in benchmarks/gpu_check.py's row e, on two GPUs)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import pytest
import torch

from runtime.devices import CommStream


def _no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("a CPU rank touched CUDA")

    for name in ("Stream", "Event", "current_stream", "stream", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, refuse)


def test_on_the_cpu_the_calls_are_the_plain_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_cuda(monkeypatch)
    comm = CommStream(torch.device("cpu"))
    assert comm.stream is None
    posted: list[str] = []
    with comm.sending():
        posted.append("isend")
    buffer = comm.empty([2, 3], torch.float16)
    assert buffer.shape == (2, 3) and buffer.dtype == torch.float16 and buffer.device.type == "cpu"
    with comm.receiving(buffer):
        posted.append("irecv")
    assert posted == ["isend", "irecv"]


class _FakeStream:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: _FakeStream) -> None:
        self.log.append(f"{self.name} waits for {other.name}")


def test_on_cuda_a_message_waits_only_where_the_note_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rules 1, 3 and 4 of [Note: communication stream], in order: a send's stream waits for
    compute before the send is posted on it; a buffer is allocated on the communication
    stream; after the receive, compute waits for the communication stream and the buffer is
    recorded as compute's."""
    log: list[str] = []
    compute = _FakeStream("compute", log)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: _FakeStream("comm", log))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: compute)

    @contextlib.contextmanager
    def on(stream: _FakeStream) -> Iterator[None]:
        log.append(f"on {stream.name}")
        yield
        log.append(f"off {stream.name}")

    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: log.append(f"buffer recorded on {s.name}"))
    monkeypatch.setattr(torch, "empty", lambda *a, **k: log.append("allocate") or torch.zeros(1))
    comm = CommStream(torch.device("cuda", 0))
    with comm.sending():
        log.append("isend")
    assert log == ["comm waits for compute", "on comm", "isend", "off comm"]
    log.clear()
    buffer = comm.empty([4], torch.float32)
    with comm.receiving(buffer):
        log.append("irecv and wait")
    assert log == ["on comm", "allocate", "off comm", "on comm", "irecv and wait", "off comm",
                   "compute waits for comm", "buffer recorded on compute"]
