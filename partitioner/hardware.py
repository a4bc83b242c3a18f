"""Hardware profiles: peak FLOP/s, memory, bandwidths and link latencies.

Built-in JSON profiles for A100, H100 and H200 live in `profiles/` with their sources
cited; `cpu` is measured on the spot (matmul FLOP/s, copy bandwidth, physical memory)
and cached, so two compiles on one machine agree; `--hardware FILE` takes a user's own
JSON with the same fields.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import cache
from .errors import PartitionerError

__all__ = ["Hardware", "load_hardware", "BUILTIN"]

BUILTIN = ("cpu", "a100", "h100", "h200")
_PROFILES = Path(__file__).with_name("profiles")


@dataclass(frozen=True)
class Hardware:
    """One device type and the links between devices of it."""

    name: str
    peak_flops: float  # FLOP/s the MFU is quoted against
    memory_bandwidth: float  # bytes/s
    memory_bytes: int  # per device
    intra_node_bandwidth: float  # bytes/s, one direction, device to device
    intra_node_latency_s: float
    inter_node_bandwidth: float = 0.0
    inter_node_latency_s: float = 0.0
    devices_per_node: int = 1
    efficiency: float = 1.0  # achievable fraction of peak for the roofline
    description: str = ""
    peak_flops_fp32: float = 0.0
    sources: tuple[str, ...] = field(default_factory=tuple)

    @property
    def p2p_alpha_s(self) -> float:
        return self.intra_node_latency_s

    @property
    def p2p_beta_s_per_byte(self) -> float:
        return 1.0 / self.intra_node_bandwidth if self.intra_node_bandwidth > 0 else 0.0


def load_hardware(name: str | None) -> Hardware:
    """A built-in profile by name, a JSON file by path, or (None) this machine's."""
    if name is None:
        name = _this_machine()
    if name in BUILTIN:
        return _cpu() if name == "cpu" else _from_json(_PROFILES / f"{name}.json")
    path = Path(name)
    if path.is_file():
        return _from_json(path)
    raise PartitionerError(
        f"unknown --hardware {name!r}: give one of {', '.join(BUILTIN)} or the path of a JSON "
        f"profile with the fields of partitioner/profiles/h100.json."
    )


def _from_json(path: Path) -> Hardware:
    try:
        raw = json.loads(path.read_text())
        raw["sources"] = tuple(raw.get("sources", ()))
        return Hardware(**raw)
    except (OSError, ValueError, TypeError) as exc:
        raise PartitionerError(
            f"hardware profile {path} is not valid ({exc}); copy partitioner/profiles/h100.json "
            f"and edit its numbers."
        ) from None


def _this_machine() -> str:
    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name().lower()
        for name in ("h200", "h100", "a100"):
            if name in gpu:
                return name
    return "cpu"


def _cpu() -> Hardware:
    """This CPU, measured once per machine and cached."""
    key = f"hardware-cpu-{socket.gethostname()}-{torch.__version__}-{torch.get_num_threads()}"
    raw = cache.get(key)
    if raw is None:
        raw = asdict(_measure_cpu())
        cache.put(key, raw)
    raw["sources"] = tuple(raw.get("sources", ()))
    return Hardware(**raw)


def _measure_cpu() -> Hardware:
    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    flops = 10 * 2 * n**3 / (time.perf_counter() - start)
    big = torch.empty(8 << 20)  # 32 MiB
    dst = torch.empty_like(big)
    dst.copy_(big)
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(big)
    bandwidth = 5 * 2 * big.numel() * 4 / (time.perf_counter() - start)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Hardware(
        name="cpu",
        description=f"this machine's CPU ({os.cpu_count()} cores), measured",
        peak_flops=float(f"{flops:.3g}"),
        peak_flops_fp32=float(f"{flops:.3g}"),
        memory_bandwidth=float(f"{bandwidth:.3g}"),
        memory_bytes=int(memory),
        # gloo over loopback TCP: typical latency and bandwidth on a small VM
        intra_node_bandwidth=2e9,
        intra_node_latency_s=50e-6,
        efficiency=1.0,
        sources=("measured: 512x512 float32 matmul, 32 MiB copy, sysconf physical pages",
                 "gloo loopback latency/bandwidth: default estimate"),
    )
