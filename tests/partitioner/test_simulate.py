"""The step simulator against hand-computed makespans and the closed-form bubble."""

from __future__ import annotations

import pytest

from partitioner.roofline import message_s, mfu, roofline_s, stage_memory_bytes
from partitioner.simulate import bubble_fraction, simulate


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages, microbatches", [(2, 4), (3, 6), (4, 4), (4, 16)])
def test_balanced_pipeline_takes_m_plus_s_minus_1_slots(schedule: str, stages: int, microbatches: int) -> None:
    """Forward 1, backward 2 on every stage, free links: (M + S - 1) * 3."""
    links = {(k, k + 1): 0.0 for k in range(stages - 1)}
    sim = simulate([1.0] * stages, [2.0] * stages, links, schedule, stages, microbatches)
    assert sim.step_time_s == pytest.approx((microbatches + stages - 1) * 3.0)
    busy = microbatches * 3.0
    assert 1 - busy / sim.step_time_s == pytest.approx(bubble_fraction(stages, microbatches))


def test_two_stage_1f1b_with_uneven_stages_and_a_link() -> None:
    """Stage 0: F 1, B 2; stage 1: F 2, B 4; each message 0.5; M = 2.

    time     0    1   1.5  2   3.5        7.5  8        9.5 10       13.5 14    16
    rank 0  |0F0 |0F1 |                        |0B0     |            |0B1   |
    rank 1            |1F0     |1B0      |1F1      |1B1         |
    """
    sim = simulate([1.0, 2.0], [2.0, 4.0], {(0, 1): 0.5}, "1f1b", 2, 2)
    assert sim.step_time_s == pytest.approx(16.0)
    assert sim.busy_s == (6.0, 12.0)


@pytest.mark.parametrize("stages", [2, 4])
def test_1f1b_keeps_fewer_microbatches_in_flight_than_gpipe(stages: int) -> None:
    links = {(k, k + 1): 0.0 for k in range(stages - 1)}
    one = simulate([1.0] * stages, [2.0] * stages, links, "1f1b", stages, 8)
    gpipe = simulate([1.0] * stages, [2.0] * stages, links, "gpipe", stages, 8)
    assert one.peak_inflight == tuple(stages - k for k in range(stages))
    assert gpipe.peak_inflight == (8,) * stages


def test_interleaved_shrinks_the_bubble() -> None:
    """4 ranks x 2 virtual stages of half the work each, against 4 plain stages."""
    plain = simulate([1.0] * 4, [2.0] * 4, {(k, k + 1): 0.0 for k in range(3)}, "1f1b", 4, 8)
    inter = simulate([0.5] * 8, [1.0] * 8, {(k, k + 1): 0.0 for k in range(7)}, "interleaved", 4, 8, virtual=2)
    assert inter.step_time_s < plain.step_time_s
    assert inter.step_time_s == pytest.approx(8 * 3.0 + 3 * 3.0 / 2)


def test_roofline_and_friends() -> None:
    assert roofline_s(2e12, 1e9, peak_flops=1e12, bandwidth=1e12) == pytest.approx(2.0)  # compute-bound
    assert roofline_s(1e9, 4e12, peak_flops=1e12, bandwidth=1e12) == pytest.approx(4.0)  # memory-bound
    assert roofline_s(1e12, 0, peak_flops=1e12, bandwidth=1e12, efficiency=0.5) == pytest.approx(2.0)
    assert message_s(0, 1e-5, 1e-9) == 0.0
    assert message_s(1e6, 1e-5, 1e-9) == pytest.approx(1e-5 + 1e-3)
    assert stage_memory_bytes(100, 10, inflight=3, optimizer_factor=2) == 100 * 4 + 30
    assert mfu(1e15, 1.0, 8, 1e15) == pytest.approx(1 / 8)
