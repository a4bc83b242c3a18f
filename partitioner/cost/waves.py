"""Tile and wave quantization: the part of a GPU a matrix multiply of a given shape keeps busy.

[Note: waves of tiles]
    A GPU computes a matrix product C (M x N) in output tiles of tile_m x tile_n, one tile
    per streaming multiprocessor at a time: ceil(M / tile_m) x ceil(N / tile_n) tiles per
    matrix (tile quantization: a partial tile costs a whole one), run in waves of `sm_count`
    tiles (wave quantization: a partial last wave costs a whole one).  A product of `batch`
    matrices therefore keeps busy the fraction  M N batch / (waves x sm_count x tile_m x tile_n)
    of the machine, and its compute takes peak x efficiency x that fraction (NVIDIA, "Matrix
    Multiplication Background User's Guide", 2023: section 2.3, cuBLAS's typical tiles, 256 x
    128 the most efficient; sections 3.1 and 3.2, tile and wave quantization on the A100's 108
    SMs).  Small products lose most (a 2048 x 2304 output is 144 tiles of 256 x 128: two waves
    on 108 SMs, the second a third full); the wide ones of a large model hardly any.  A
    product of fewer tiles than one wave is not charged so: cuBLAS spreads it over the SMs
    with smaller tiles or by splitting K, so it keeps the machine busy (fraction 1, its FLOPs
    at the profile's efficiency, as without waves).  The profile's `efficiency` is then what
    a full wave of tiles achieves.  A node's product is
    read off its output: a node that reads a weight multiplies all rows at once (M is every
    leading dimension together), one of two activations (q @ k^T) multiplies one matrix per
    leading index.  Profiles without `sm_count` (the CPU) have no waves: the fraction is 1.
    Where a tensor-parallel split changes a product's shape, its cost follows the shard's
    waves (`shard_factor`, used by partitioner/tp/rewrite.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .hardware import Hardware

__all__ = ["busy_fraction", "node_fraction", "output_shape", "shard_factor"]


def busy_fraction(batch: int, m: int, n: int, sm_count: int, tile_m: int, tile_n: int) -> float:
    """The fraction of the machine a product of `batch` (m x n) outputs keeps busy ([Note:
    waves of tiles]); 1.0 where the profile has no SMs or tiles, or the product is empty."""
    if sm_count <= 0 or tile_m <= 0 or tile_n <= 0 or min(batch, m, n) <= 0:
        return 1.0
    tiles = batch * math.ceil(m / tile_m) * math.ceil(n / tile_n)
    if tiles < sm_count:  # less than a wave: smaller tiles or split K spread it
        return 1.0
    waves = math.ceil(tiles / sm_count)
    return batch * m * n / (waves * sm_count * tile_m * tile_n)


def node_fraction(shape: tuple[int, ...] | None, reads_weight: bool, hardware: Hardware) -> float:
    """The busy fraction of a node whose output has `shape` ([Note: waves of tiles]): all
    leading dimensions as rows where it multiplies by a weight, else one matrix per leading
    index; 1.0 for an output of fewer than two dimensions (no tiled product)."""
    if shape is None or len(shape) < 2:
        return 1.0
    rows, n = math.prod(shape[:-1]), shape[-1]
    batch, m = (1, rows) if reads_weight else (math.prod(shape[:-2]), shape[-2])
    return busy_fraction(batch, m, n, hardware.sm_count, hardware.gemm_tile_m, hardware.gemm_tile_n)


def shard_factor(whole: tuple[int, ...] | None, local: tuple[int, ...] | None, reads_weight: bool,
                 hardware: Hardware) -> float:
    """By what a node's time changes, beyond the share of its work, when it computes the shard
    `local` of the product `whole` ([Note: waves of tiles]): the whole's busy fraction over
    the shard's."""
    return node_fraction(whole, reads_weight, hardware) / node_fraction(local, reads_weight, hardware)


def output_shape(value: Any) -> tuple[int, ...] | None:
    """The shape of a node's value, where it is one tensor."""
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None
