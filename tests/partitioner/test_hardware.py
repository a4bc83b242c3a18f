"""Hardware profiles: the built-in ones, a user's JSON, wrong input, and the measured cpu."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest
import torch

from partitioner.cost import hardware, measure
from partitioner.errors import PartitionerError
from partitioner.cost.hardware import BUILTIN, Hardware, load_hardware

GPUS = [name for name in BUILTIN if name != "cpu"]


@pytest.mark.parametrize("name", GPUS)
def test_builtin_profile_loads_with_its_sources(name: str) -> None:
    hw = load_hardware(name)
    assert hw.name == name
    assert hw.sources and all(isinstance(s, str) and s for s in hw.sources)
    assert hw.peak_flops > hw.peak_flops_fp32 > 0
    assert hw.memory_bytes > 0 and hw.memory_bandwidth > 0
    assert hw.intra_node_bandwidth > 0 and hw.intra_node_latency_s > 0
    assert hw.p2p_beta_s_per_byte == pytest.approx(1 / hw.intra_node_bandwidth)


def test_stages_are_profiled_idle_only_where_communication_shares_the_cores() -> None:
    gpu = load_hardware("h100")
    assert gpu.overlaps_comm and gpu.idle_before_compute_s == 0.0  # NCCL on its own streams
    cpu = dataclasses.replace(gpu, overlaps_comm=False, p2p_send_post_s=3e-4, p2p_recv_post_s=1e-4)
    assert cpu.idle_before_compute_s == pytest.approx(3e-4 + 1e-4 + gpu.p2p_alpha_s)


def test_a_stage_pays_the_posts_of_its_messages_where_receives_are_posted_ahead() -> None:
    """[Note: receives posted ahead]: on the CPU (gloo) the solver charges each end of a
    message what posting it costs (the mean of a send and a receive), not the round trip,
    which moves during the compute before; on a GPU (NCCL, no early receives) the latency."""
    from partitioner.predict.predict import stage_message_s

    gpu = load_hardware("a100")
    assert not gpu.receives_ahead
    assert stage_message_s(gpu, 2, 1) == gpu.intra_node_latency_s
    cpu = dataclasses.replace(gpu, name="cpu", devices_per_node=8, intra_node_latency_s=9e-4,
                              p2p_send_post_s=3e-4, p2p_recv_post_s=1e-4)
    assert cpu.receives_ahead
    assert stage_message_s(cpu, 2, 1) == pytest.approx(2e-4)


def test_user_profile_loads_from_a_path(tmp_path: Path) -> None:
    raw = json.loads((hardware._PROFILES / "h100.json").read_text())
    raw.update(name="my-gpu", peak_flops=1e15, intra_node_latency_s=2e-6, sources=["my own numbers"])
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(raw))
    hw = load_hardware(str(path))
    assert (hw.name, hw.peak_flops, hw.p2p_alpha_s, hw.sources) == ("my-gpu", 1e15, 2e-6, ("my own numbers",))


def test_unknown_name_is_a_clear_error() -> None:
    with pytest.raises(PartitionerError, match=r"unknown --hardware 'tpu9': give one of cpu, a100, h100, h200 or the path"):
        load_hardware("tpu9")


@pytest.mark.parametrize("text, why", [
    ('{"name": "x", "peak_flops": ', r"Expecting value"),
    ("[1, 2, 3]", r"holds a JSON list, not an object"),
    ('{"name": "x", "peak_flops": 1e12}', r"missing .* required positional arguments"),
    ('{"name": "x", "peak_flops": 1e12, "memory_bandwidth": 1e12, "memory_bytes": 8, "intra_node_bandwidth": 1e9, '
     '"intra_node_latency_s": 1e-6, "flops_per_watt": 3}', r"unexpected keyword argument 'flops_per_watt'"),
    ('{"name": "x", "peak_flops": "fast", "memory_bandwidth": 1e12, "memory_bytes": 8, "intra_node_bandwidth": 1e9, '
     '"intra_node_latency_s": 1e-6}', r"field 'peak_flops' must be a non-negative number, not 'fast'"),
    ('{"name": "x", "peak_flops": 1e12, "memory_bandwidth": 1e12, "memory_bytes": 8, "intra_node_bandwidth": 0, '
     '"intra_node_latency_s": 1e-6}', r"field 'intra_node_bandwidth' must be positive"),
])
def test_malformed_profile_is_a_clear_error(tmp_path: Path, text: str, why: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(PartitionerError, match=rf"hardware profile .*bad\.json is not valid \(.*{why}.*\); copy "
                                               r"partitioner/profiles/h100\.json"):
        load_hardware(str(path))


def test_fit_recovers_alpha_and_beta() -> None:
    alpha, beta = 80e-6, 1 / 2.5e9
    sizes = measure._SIZES
    got = measure._fit(sizes, [alpha + n * beta for n in sizes])
    assert got is not None
    assert got[0] == pytest.approx(alpha, rel=1e-6) and got[1] == pytest.approx(beta, rel=1e-6)
    # a latency below the timer's reach: alpha clamps to 0, beta through the origin
    clamped = measure._fit(sizes, [n * beta * (0.8 if n == sizes[0] else 1.0) for n in sizes])
    assert clamped is not None and clamped[0] == 0.0 and clamped[1] > 0
    assert measure._fit(sizes, [1e-3] * len(sizes)) is None  # no bandwidth term: not a link


def test_cpu_profile_measures_gloo_once_and_caches_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PARTITIONER_CACHE", str(tmp_path / "cache"))
    hw = load_hardware("cpu")  # how long measuring takes: benchmarks/cpu_profile.py
    assert hw.name == "cpu" and hw.peak_flops > 0 and hw.memory_bandwidth > 0
    assert hw.intra_node_latency_s > 0 and hw.intra_node_bandwidth > 0
    assert hw.allreduce_latency_s >= 0 and hw.allreduce_bandwidth > 0
    assert any(s.startswith("measured: gloo between 2 processes") for s in hw.sources), hw.sources
    # the pipeline's messages under load: both posts cost something, and a stage waits for
    # a message at least as long as the message itself
    assert hw.p2p_send_post_s > 0 and hw.p2p_recv_post_s > 0
    assert hw.send_post_s == hw.p2p_send_post_s
    assert hw.message_wait_s == pytest.approx(hw.p2p_send_post_s + hw.p2p_recv_post_s + hw.p2p_alpha_s)
    assert any("under a 2-rank 1F1B exchange" in s for s in hw.sources), hw.sources
    # the second load is the cached profile, field for field: compiles stay byte-identical
    monkeypatch.setattr(hardware, "measure_cpu", lambda: pytest.fail("measured twice"))
    assert load_hardware("cpu") == hw
    assert list((tmp_path / "cache").glob(f"hardware-cpu-v{hardware._CPU_PROFILE_VERSION}-*.json"))


def test_cpu_profile_falls_back_when_gloo_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PARTITIONER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(measure, "_measure_gloo", lambda: None)
    hw = load_hardware("cpu")
    assert (hw.intra_node_latency_s, hw.intra_node_bandwidth) == (measure._DEFAULT_ALPHA_S, measure._DEFAULT_BANDWIDTH)
    assert any("fallback estimate" in s for s in hw.sources), hw.sources
    assert (hw.p2p_send_post_s, hw.p2p_recv_post_s) == (0.0, 0.0)
    assert hw.send_post_s == hw.p2p_alpha_s  # a send then costs its sender the link's latency


def _silent_peer(conn: object, timeout_s: float) -> None:
    time.sleep(60)  # a peer that never joins


@pytest.mark.timeout(30)  # stops the hang: the silent peer sleeps 60 s
def test_gloo_measurement_cannot_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(measure, "_gloo_peer", _silent_peer)
    assert measure._measure_gloo(timeout_s=1.0) is None


def test_cached_profile_of_another_shape_is_measured_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from partitioner.cost import cache

    monkeypatch.setenv("PARTITIONER_CACHE", str(tmp_path / "cache"))
    fake = Hardware(name="cpu", peak_flops=1e9, memory_bandwidth=1e9, memory_bytes=1, intra_node_bandwidth=1e9,
                    intra_node_latency_s=1e-5, sources=("fake",))
    monkeypatch.setattr(hardware, "measure_cpu", lambda: dataclasses.asdict(fake))
    hw = load_hardware("cpu")
    assert hw == fake
    entry = next((tmp_path / "cache").glob("hardware-cpu-*.json"))
    entry.write_text(json.dumps({"name": "cpu", "flops": 1}))  # a profile of another shape
    monkeypatch.setattr(hardware, "measure_cpu", lambda: dataclasses.asdict(dataclasses.replace(fake, sources=("again",))))
    assert load_hardware("cpu").sources == ("again",)
    stored = cache.get(entry.stem)
    assert stored is not None and stored["sources"] == ["again"]


def test_cpu_profile_is_measured_on_a_ranks_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks compute on RANK_THREADS threads (OMP_NUM_THREADS=1 under torchrun): so is
    the matmul the cpu profile times, whatever the compiling process has; and its own
    thread count is given back."""
    monkeypatch.setenv("PARTITIONER_CACHE", str(tmp_path / "cache"))
    seen: list[int] = []
    fake = Hardware(name="cpu", peak_flops=1e9, memory_bandwidth=1e9, memory_bytes=1, intra_node_bandwidth=1e9,
                    intra_node_latency_s=1e-5, sources=("fake",))
    monkeypatch.setattr(hardware, "measure_cpu", lambda: (seen.append(torch.get_num_threads()), dataclasses.asdict(fake))[1])
    before = torch.get_num_threads()
    torch.set_num_threads(measure.RANK_THREADS + 1)
    try:
        load_hardware("cpu")
        assert torch.get_num_threads() == measure.RANK_THREADS + 1
    finally:
        torch.set_num_threads(before)
    assert seen == [measure.RANK_THREADS]
