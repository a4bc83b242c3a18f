"""Train and eval modes, and the random stream of each microbatch's forward.

[Note: dropout streams]
    In training mode, the forward of microbatch i of stage s in call n of a pipeline
    (n counts train_step, evaluate and pipe(...) calls: every rank makes the same calls)
    runs under a generator seeded from (the package's seed, n, s, i) alone, the caller's
    RNG state saved and restored around it (torch.random.fork_rng).  So a run is
    reproducible for a given plan and whatever the interleaving of the schedule, and a
    recomputed forward (torch.utils.checkpoint, which keeps the RNG state it started
    with) draws the same masks.  The masks are not those of the unsplit model (which
    draws the whole batch from one stream): dropout is equal in distribution, not in
    values.  Every tensor-parallel rank of a stage draws the same stream, so a replicated
    value gets the same mask on each; a value sharded across the tp group also gets the
    same stream on each shard (Megatron's per-rank stream for sharded values is not built).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["microbatch_seed", "seeded"]

_MIX = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: consecutive keys land far apart


def microbatch_seed(seed: int, call: int, stage: int, microbatch: int) -> int:
    """The seed of one forward ([Note: dropout streams]): a 63-bit mix of the four numbers."""
    h = seed & (2**64 - 1)
    for part in (call, stage, microbatch):
        h = ((h ^ part) * _MIX + 0x632BE59BD9B4E019) & (2**64 - 1)
        h ^= h >> 29
    return h & (2**63 - 1)


@contextlib.contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Run the body with torch's generators (CPU and `device`'s) seeded by `seed`, restored after."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield
