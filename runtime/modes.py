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
    values.

    Under tensor parallelism every rank of a stage's tp group starts from that same
    stream, so a dropout of a replicated value draws the same mask on each rank and the
    value stays replicated.  A dropout of a value sharded across the group (Megatron's
    RNG tracker: its "model-parallel" stream) is written by codegen inside
    `with tp.rank_stream(x.device, self.training):` (codegen/source.py), which draws one
    number from the shared CPU stream (so that stream moves alike on every rank) and
    runs the dropout under a generator seeded by that number mixed with the tp rank
    (`mix`), restored after: each shard its own mask, still a function of (seed, n, s,
    i) alone, so reruns and recomputation reproduce it.  `LocalPipeline`'s tp lanes
    share one process's generator, so they take turns between collectives, each with
    its own generator state ([Note: lanes] in lanes.py).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["microbatch_seed", "mix", "seeded"]

_MIX = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: consecutive keys land far apart


def mix(seed: int, *parts: int) -> int:
    """A 63-bit seed mixed from `seed` and `parts`, in order ([Note: dropout streams])."""
    h = seed & (2**64 - 1)
    for part in parts:
        h = ((h ^ part) * _MIX + 0x632BE59BD9B4E019) & (2**64 - 1)
        h ^= h >> 29
    return h & (2**63 - 1)


def microbatch_seed(seed: int, call: int, stage: int, microbatch: int) -> int:
    """The seed of one forward ([Note: dropout streams]): the four numbers mixed."""
    return mix(seed, call, stage, microbatch)


@contextlib.contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Run the body with torch's generators (CPU and `device`'s) seeded by `seed`, restored after.

    On the CPU only the CPU generator is saved, seeded and restored: `torch.manual_seed`
    also queues a seed for CUDA's lazy initialisation, and on a CPU-only process that
    records the caller's stack each time (0.5 ms a forward at a pipeline's depth, which
    made small steps up to 1.5x slower)."""
    if device.type == "cuda":
        with torch.random.fork_rng(devices=[device]):
            torch.manual_seed(seed)
            yield
        return
    cpu = torch.default_generator
    state = cpu.get_state()
    cpu.manual_seed(seed)
    try:
        yield
    finally:
        cpu.set_state(state)
