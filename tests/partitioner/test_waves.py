"""Tile and wave quantization of matrix products ([Note: waves of tiles] in
partitioner/cost/waves.py): the fractions of NVIDIA's guide on the A100's 108 SMs, and the
analytic cost of a node following them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from partitioner.cost.hardware import load_hardware
from partitioner.cost.profile import annotate
from partitioner.cost.waves import busy_fraction, node_fraction, shard_factor
from partitioner.trace.passes import propagate, specialize
from partitioner.trace.trace import trace

A100 = load_hardware("a100")


def _busy(batch: int, m: int, n: int) -> float:
    return busy_fraction(batch, m, n, A100.sm_count, A100.gemm_tile_m, A100.gemm_tile_n)


def test_whole_waves_keep_every_sm_busy_and_a_partial_one_costs_a_whole() -> None:
    assert (A100.sm_count, A100.gemm_tile_m, A100.gemm_tile_n) == (108, 256, 128)
    assert _busy(1, 256 * 12, 128 * 9) == 1.0  # 108 tiles: one full wave
    assert _busy(1, 2048, 2304) == pytest.approx(144 / 216)  # 144 tiles: the second wave a third full
    assert _busy(1, 16384, 160) == pytest.approx(16384 * 160 / (2 * 108 * 256 * 128))  # a partial tile is a whole one
    assert _busy(1, 2048, 160) == 1.0  # 16 tiles, less than a wave: spread by smaller tiles
    assert _busy(16, 2048, 2048) == pytest.approx(2048 / (19 * 108))  # one matrix per batch index


def test_a_weight_multiplies_all_rows_at_once_and_activations_one_matrix_each() -> None:
    assert node_fraction((4, 512, 2304), True, A100) == _busy(1, 2048, 2304)
    assert node_fraction((4, 512, 2304), False, A100) == _busy(4, 512, 2304)
    assert node_fraction((2304,), True, A100) == 1.0
    assert shard_factor((2048, 6912), (2048, 3456), True, A100) == _busy(1, 2048, 6912) / _busy(1, 2048, 3456)


def test_a_profile_without_sms_has_no_waves() -> None:
    flat = dataclasses.replace(A100, sm_count=0)
    assert node_fraction((2048, 2304), True, flat) == 1.0


def test_the_analytic_cost_of_a_linear_follows_its_waves() -> None:
    """A 2048 x 2304 output is 144 tiles, a wave and a third: it takes as long as two full
    waves of 216 tiles, 216 / 144 times its FLOPs at the profile's efficiency."""
    model, x = torch.nn.Linear(1024, 2304), torch.randn(2048, 1024)
    gm = trace(model, (x,), {}, "fx").gm
    values = propagate(gm, [x])
    specialize(gm, values)
    hw = dataclasses.replace(A100, tf32=False, peak_flops_fp32=A100.peak_flops)  # one peak for float32 too
    cost = annotate(gm, values, hw, measure=False)["linear"]
    flops = 2 * 2048 * 1024 * 2304
    assert cost.flops == flops
    assert cost.forward_s == pytest.approx(flops / (hw.peak_flops * hw.efficiency * 144 / 216))
