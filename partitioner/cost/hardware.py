"""Hardware profiles: peak FLOP/s, memory, bandwidths and link latencies.

Built-in JSON profiles for A100, H100 and H200 live in `profiles/` with their sources
cited; `cpu` is measured on the spot (matmul FLOP/s, copy bandwidth, physical memory, and
gloo point-to-point and all-reduce alpha-beta over 127.0.0.1) and cached, so two compiles
on one machine agree; `--hardware FILE` takes a user's own JSON with the same fields.

[Note: a peak per dtype]
    A profile gives the peak FLOP/s of each dtype a matmul runs in: `peak_flops` that of
    bfloat16 and float16 on the tensor cores (an older profile's single peak is this one),
    `peak_flops_tf32` that of float32 on the tensor cores as TF32, `peak_flops_fp32` that
    of float32 on the CUDA cores.  Float32 matmuls run as TF32 only where the training run
    sets `torch.backends.cuda.matmul.allow_tf32 = True` (PyTorch's default is False): the
    profile's `tf32` says whether it assumes so.  The analytic cost of a node is charged
    at the peak of the dtype it computes in (`peak_for`, with `nodes.compute_dtype`), and
    a plan's MFU is quoted against the peak of the dtype most of its FLOPs run in
    (`predict.mfu_peak`: a model built in bfloat16 trains in bfloat16 under --precision
    fp32 too), else of its precision (`precision_peak`), which the manifest's
    `predicted` block (`mfu_peak`, `mfu_peak_flops`) and plan.txt name.  A
    profile without a float32 peak charges float32 at `peak_flops`, as before.

The links follow the alpha-beta model (Hockney 1994): a message of n bytes takes
alpha + n * beta.  The CPU's numbers are measured by `measure.py`.
"""

from __future__ import annotations

import json
import math
import socket
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from ..errors import PartitionerError
from . import cache
from .measure import RANK_THREADS, measure_cpu, rank_threads

__all__ = ["Hardware", "load_hardware", "BUILTIN"]

BUILTIN = ("cpu", "a100", "h100", "h200")
_PROFILES = Path(__file__).parent.parent / "profiles"


@dataclass(frozen=True)
class Hardware:
    """One device type and the links between devices of it."""

    name: str
    peak_flops: float  # FLOP/s of bfloat16 / float16 matmuls ([Note: a peak per dtype])
    memory_bandwidth: float  # bytes/s
    memory_bytes: int  # per device
    intra_node_bandwidth: float  # bytes/s, one direction, device to device
    intra_node_latency_s: float
    inter_node_bandwidth: float = 0.0
    inter_node_latency_s: float = 0.0
    devices_per_node: int = 1
    efficiency: float = 1.0  # achievable fraction of peak for the roofline
    description: str = ""
    peak_flops_fp32: float = 0.0  # float32 without TF32 (0: unknown, charged at peak_flops)
    peak_flops_tf32: float = 0.0  # float32 matmuls as TF32 (0: unknown, charged as float32)
    #: float32 matmuls run as TF32 (the run sets torch.backends.cuda.matmul.allow_tf32)
    tf32: bool = False
    # all-reduce among 2 ranks, alpha-beta per byte of the buffer (0: unknown, use p2p)
    allreduce_latency_s: float = 0.0
    allreduce_bandwidth: float = 0.0
    #: collectives run beside compute (NCCL on its own stream); not on the CPU, where
    #: gloo's threads take the cores the ranks compute on
    overlaps_comm: bool = True
    #: what posting one pipeline send / receive costs the rank that posts it, on average
    #: (0: a send costs the link's alpha, a receive nothing); see `measure._loaded_exchange`
    p2p_send_post_s: float = 0.0
    p2p_recv_post_s: float = 0.0
    #: bytes/s, one direction, between a device and its host's memory (activation
    #: offloading); 0: unknown, a copy within memory (`memory_bandwidth`: the cpu's)
    host_link_bandwidth: float = 0.0
    #: streaming multiprocessors and the output tile of a matrix multiply on one of them
    #: ([Note: waves of tiles] in waves.py); 0: no waves (every product keeps all busy)
    sm_count: int = 0
    gemm_tile_m: int = 0
    gemm_tile_n: int = 0
    sources: tuple[str, ...] = field(default_factory=tuple)

    @property
    def host_bandwidth(self) -> float:
        """Bytes/s of an activation's copy to the host or back (`host_link_bandwidth`)."""
        return self.host_link_bandwidth or self.memory_bandwidth

    @property
    def copies_overlap(self) -> bool:
        """Whether offloading's copies run beside the compute (a CUDA side stream) as the
        collectives do (`overlaps_comm`); not on the CPU, where each is done inside the
        forward that makes it ([Note: activation offloading] in runtime/offload.py)."""
        return self.overlaps_comm

    def peak_for(self, dtype: torch.dtype | None) -> float:
        """The peak FLOP/s of a matmul computing in `dtype` ([Note: a peak per dtype])."""
        return self.named_peak(dtype)[1]

    def named_peak(self, dtype: torch.dtype | None) -> tuple[str, float]:
        """(name, FLOP/s) of the peak of a matmul computing in `dtype`: bf16 / fp16 at
        `peak_flops`; anything else (float32, float64, None: no floating tensor) as float32,
        tf32 where the profile assumes it and knows its peak ([Note: a peak per dtype])."""
        if dtype in (torch.bfloat16, torch.float16):
            return ("bf16" if dtype == torch.bfloat16 else "fp16"), self.peak_flops
        if self.tf32 and self.peak_flops_tf32 > 0:
            return "tf32", self.peak_flops_tf32
        return "fp32", self.peak_flops_fp32 or self.peak_flops

    def precision_peak(self, precision: str) -> tuple[str, float]:
        """(name, FLOP/s) of the peak of a plan trained in `precision` (`named_peak` of its
        matmuls' dtype)."""
        dtypes = {"fp32": torch.float32, "fp16-mixed": torch.float16}
        return self.named_peak(dtypes.get(precision, torch.bfloat16))

    @property
    def p2p_alpha_s(self) -> float:
        return self.intra_node_latency_s

    @property
    def p2p_beta_s_per_byte(self) -> float:
        return 1.0 / self.intra_node_bandwidth if self.intra_node_bandwidth > 0 else 0.0

    @property
    def message_wait_s(self) -> float:
        """How long a pipeline stage idles waiting for one message: posting the receive,
        the peer posting its send, and the message."""
        return self.p2p_recv_post_s + self.send_post_s + self.p2p_alpha_s

    @property
    def idle_before_compute_s(self) -> float:
        """How long a stage is profiled idling before each forward and backward: one
        message's wait where gloo's threads share the cores the ranks compute on (compute
        right after an idle runs slower: cost/calibrate.py, [Note: compute after a wait]), else 0
        (GPUs: NCCL on its own streams)."""
        return 0.0 if self.overlaps_comm else self.message_wait_s

    @property
    def receives_ahead(self) -> bool:
        """Whether the runtime posts pipeline receives a compute ahead here: on the CPU
        (gloo) yes; on GPUs no, NCCL matching messages in the order they are posted
        ([Note: receives posted ahead] in runtime/schedule/lowering.py)."""
        return self.name == "cpu"

    @property
    def send_post_s(self) -> float:
        """What posting one pipeline send costs its sender."""
        return self.p2p_send_post_s or self.p2p_alpha_s

    def ring_link(self, across_nodes: bool = False) -> tuple[float, float]:
        """(alpha s, beta s/byte) of one step of a ring collective: the inter-node link when
        the ring leaves a node (a ring is as slow as its slowest step), else the measured
        2-rank all-reduce when the profile has one (2 alpha + n beta), else the intra-node
        point-to-point link."""
        if across_nodes and self.inter_node_bandwidth > 0:
            return self.inter_node_latency_s, 1.0 / self.inter_node_bandwidth
        if self.allreduce_bandwidth > 0:
            return self.allreduce_latency_s / 2, 1.0 / self.allreduce_bandwidth
        return self.p2p_alpha_s, self.p2p_beta_s_per_byte


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
        if not isinstance(raw, dict):
            raise ValueError(f"it holds a JSON {type(raw).__name__}, not an object")
        raw["sources"] = tuple(raw.get("sources", ()))
        hw = Hardware(**raw)
        _check_fields(hw)
        return hw
    except (OSError, ValueError, TypeError) as exc:
        raise PartitionerError(
            f"hardware profile {path} is not valid ({exc}); copy partitioner/profiles/h100.json "
            f"and edit its numbers."
        ) from None


def _check_fields(hw: Hardware) -> None:
    """Numbers where numbers belong: a string or a negative bandwidth is an error, not a
    plan built on nonsense."""
    for f in fields(hw):
        value = getattr(hw, f.name)
        if f.name in ("name", "description"):
            if not isinstance(value, str):
                raise ValueError(f"field {f.name!r} must be a string, not {value!r}")
        elif f.name == "sources":
            if not all(isinstance(v, str) for v in value):
                raise ValueError("field 'sources' must be a list of strings")
        elif f.name in ("overlaps_comm", "tf32"):
            if not isinstance(value, bool):
                raise ValueError(f"field {f.name!r} must be true or false, not {value!r}")
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"field {f.name!r} must be a non-negative number, not {value!r}")
    for name in ("peak_flops", "memory_bandwidth", "memory_bytes", "intra_node_bandwidth"):
        if not getattr(hw, name) > 0:
            raise ValueError(f"field {name!r} must be positive")


def _this_machine() -> str:
    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name().lower()
        for name in ("h200", "h100", "a100"):
            if name in gpu:
                return name
    return "cpu"


#: bump when the measurement changes, so profiles cached by older code are measured again
_CPU_PROFILE_VERSION = 6


def _cpu() -> Hardware:
    """This CPU as one rank computes on it (`rank_threads`), measured once per machine and
    cached (the cached value is reused, so compiles on one machine stay byte-identical)."""
    with rank_threads():
        return _cpu_profile()


def _cpu_profile() -> Hardware:
    from runtime.affinity import binding_enabled

    key = (f"hardware-cpu-v{_CPU_PROFILE_VERSION}-{socket.gethostname()}-{torch.__version__}-"
           f"{RANK_THREADS}-{'bound' if binding_enabled() else 'free'}")
    raw = cache.get(key)
    try:
        if isinstance(raw, dict):
            raw["sources"] = tuple(raw.get("sources", ()))
            return Hardware(**raw)
    except TypeError:
        pass  # a cache entry of another shape: measure again
    hw = Hardware(**measure_cpu())
    cache.put(key, asdict(hw))  # a fallback too: the next compile must agree with this one
    return hw
