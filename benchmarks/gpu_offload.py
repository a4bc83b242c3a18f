"""Row f of the device check (benchmarks/gpu_check.py): activation offloading's overlap on
a GPT block, a GPipe step of 4 microbatches with and without `--offload all`.

Both steps run the same forwards and backwards; the offloaded one runs each forward under
`runtime.offload.Offloader` (every saved activation copied to pinned host memory on a side
stream) and brings microbatch i+1 back while the backward of i runs, as the pipelines do
([Note: activation offloading] in runtime/offload.py).  The copies cannot take less than
their bytes over the host link, so the goal is the offloaded step within 1.25x of the
longer of the plain step and the copies at the h200 profile's `host_link_bandwidth`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from partitioner.cost.hardware import load_hardware
from partitioner.cost.timer import DeviceTimer
from runtime.offload import Offloader

__all__ = ["Block", "offload_row", "offloaded_step"]

Row = dict[str, Any]


class Block(torch.nn.Module):
    """A GPT block (pre-norm attention and a 4x MLP), as examples/gpt.py writes one."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc, self.out = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hs)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(torch.nn.functional.gelu(self.fc(self.ln_2(x))))


def offloaded_step(block: torch.nn.Module, inputs: list[torch.Tensor], offloader: Offloader | None) -> Callable[[], None]:
    """One GPipe step of `block` over `inputs` (a microbatch each): every forward, then
    every backward, last first; with `offloader`, each forward's activations go to the
    host and the next backward's come back while the current one runs."""
    kept = list(block.parameters())

    def step() -> None:
        outs = []
        for i, x in enumerate(inputs):
            if offloader is None:
                outs.append(block(x).float().square().mean())
                continue
            with offloader.forward(i, [*kept, x]):
                outs.append(block(x).float().square().mean())
        for i in reversed(range(len(inputs))):
            if offloader is not None and i > 0:
                offloader.prefetch(i - 1)  # the horizon of one backward
            outs.pop().backward()
            if offloader is not None:
                offloader.release(i)
    return step


def offload_row(timer: DeviceTimer, quick: bool, d: int = 4096, heads: int = 32, rows: int = 2,
                tokens: int = 2048, microbatches: int = 4) -> Row:
    """Row f: the step with and without offloading all, the bytes copied, the goal (CUDA only)."""
    row: Row = {"check": "f offload", "case": f"GPT block d={d} bf16, {microbatches} x {rows} x {tokens} tokens, gpipe",
                "figure": "offloaded / plain step", "goal": "<= 1.25 x max(plain, copies at the host link)"}
    if not timer.is_cuda:
        return {**row, "status": "not run", "value": "CUDA only"}
    ratio, bound = measure(timer, d, heads, rows, tokens, microbatches, samples=3 if quick else 10)
    return {**row, "status": "ok" if ratio <= 1.25 * bound else "below goal", "value": round(ratio, 3),
            "goal": f"<= {1.25 * bound:.3f} (1.25 x max(1, copies / plain step))"}


def measure(timer: DeviceTimer, d: int, heads: int, rows: int, tokens: int, microbatches: int,
            samples: int) -> tuple[float, float]:
    """(offloaded step / plain step, the copies' least time / plain step) on `timer`'s device."""
    device, dtype = timer.device, torch.bfloat16 if timer.is_cuda else torch.float32
    block = Block(d, heads).to(device, dtype)
    inputs = [torch.randn(rows, tokens, d, device=device, dtype=dtype, requires_grad=True) for _ in range(microbatches)]
    plain = timer.median(offloaded_step(block, inputs, None), samples=samples)
    offloader = Offloader(1.0)
    offloaded = timer.median(offloaded_step(block, inputs, offloader), samples=samples)
    per_step = offloader.moved_bytes / (samples + 2)  # the timer's two warm-up steps included
    copies = 2 * per_step / load_hardware("h200").host_bandwidth
    return offloaded / plain, max(1.0, copies / plain)
