"""A character-level GPT trained on real text: the Python standard library's own sources,
which every machine with Python has offline.  It is a model file (compile it) and a
training script (run it under torchrun on the compiled package):

    python -m partitioner compile examples/train_gpt.py --out build/chargpt --stages 2 --precision bf16-mixed
    torchrun --nproc-per-node 2 examples/train_gpt.py build/chargpt --steps 200

The loop is what a user writes for a real model: a DataLoader with a different batch every
step (the same order on every rank) and a short last batch, AdamW with parameter groups (no
weight decay on biases, norms and position embeddings), linear warmup then cosine decay,
global gradient clipping, gradient accumulation, an evaluation in eval mode every N steps,
and a progress bar with tokens per second; `--precision bf16-mixed` (a compile option) runs
the stages and the loss under bf16 autocast, with fp32 weights and optimizer state.  The weights start from `pipe.init_weights`:
each rank makes only its own, the same on every plan.  TRAIN_GPT_SIZE=base (default small)
gives a bigger model; it must be the same when compiling and training.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import sysconfig
import time
from functools import cache
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPT, GPTConfig  # noqa: E402  (examples/gpt.py: the same nanoGPT-like model)

SIZES = {  # (layers, width, heads, sequence length, batch, corpus bytes)
    "small": (2, 64, 4, 32, 16, 40_000),  # an epoch is 71 batches, the last one of 5 rows
    "base": (6, 192, 6, 128, 32, 8_000_000),
}
LAYERS, WIDTH, HEADS, BLOCK, BATCH, CORPUS_BYTES = SIZES[os.environ.get("TRAIN_GPT_SIZE", "small")]
VOCAB = 256  # bytes


# -- the data ------------------------------------------------------------------------------


@cache
def corpus() -> torch.Tensor:
    """The bytes of the standard library's .py files, in sorted path order, as int64 tokens."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= CORPUS_BYTES:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:CORPUS_BYTES]), dtype=torch.uint8).long()


class Windows(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping windows of BLOCK + 1 tokens: inputs [:-1], targets [1:]."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // BLOCK

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.tokens[i * BLOCK: (i + 1) * BLOCK + 1]
        return window[:-1], window[1:]


def split() -> tuple[Windows, Windows]:
    """90% of the corpus to train on, the rest to evaluate."""
    tokens = corpus()
    cut = len(tokens) * 9 // 10
    return Windows(tokens[:cut]), Windows(tokens[cut:])


def loader(data: Windows, shuffle: bool, seed: int = 0) -> torch.utils.data.DataLoader[Any]:
    """Batches of BATCH windows, the last one short; shuffled the same way on every rank."""
    return torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=shuffle, drop_last=False,
                                       generator=torch.Generator().manual_seed(seed))


# -- the model file ------------------------------------------------------------------------


def build_model() -> nn.Module:
    return GPT(GPTConfig(n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS, vocab_size=VOCAB, block_size=BLOCK))


def example_inputs() -> tuple[torch.Tensor]:
    return (next(iter(loader(split()[0], shuffle=False)))[0],)


def example_target() -> torch.Tensor:
    return next(iter(loader(split()[0], shuffle=False)))[1]


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def batches() -> Iterator[tuple[tuple[torch.Tensor], torch.Tensor]]:
    """The training data `partitioner run` uses: every batch of one shuffled epoch."""
    for x, y in loader(split()[0], shuffle=True):
        yield (x,), y


def init_weights(module: nn.Module) -> None:
    """GPT-2's initialisation, one module at a time (pipe.init_weights / runtime.init_weights)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
    if isinstance(module, nn.LayerNorm):
        module.reset_parameters()


# -- the training script -------------------------------------------------------------------


def no_decay(name: str) -> dict[str, float]:
    """AdamW's parameter groups by original name: no weight decay on biases, norms, positions."""
    return {"weight_decay": 0.0} if name.endswith("bias") or ".ln_" in name or name.startswith(("ln_f", "wpe")) else {}


def learning_rate(step: int, warmup: int, total: int) -> float:
    """The factor on the peak learning rate: linear warmup, then cosine decay to a tenth."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def train(directory: str, steps: int, accumulate: int, eval_every: int, lr: float) -> list[float]:
    """Train the package `directory` under torchrun; returns the evaluation losses (every rank)."""
    import runtime  # the training ranks need the runtime only

    pipe = runtime.DistributedPipeline(directory)
    pipe.init_weights(seed=0)
    opt = pipe.make_optimizer(torch.optim.AdamW, params=no_decay, lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: learning_rate(s, max(1, steps // 10), steps))
    train_data, eval_data = split()
    evals = [evaluate(pipe, eval_data)]
    bar = _progress(steps, pipe.rank == 0)
    data, step, tokens, short, start = _epochs(train_data), 0, 0, 0, time.perf_counter()
    while step < steps:
        opt.zero_grad()
        for _ in range(accumulate):  # gradients add up over train_step calls
            x, y = next(data)
            loss = pipe.train_step((x,), y, loss_fn=lambda out, t: loss_fn(out, t) / accumulate)
            tokens, short = tokens + y.numel(), short + (len(y) < BATCH)
        norm = pipe.clip_grad_norm_(1.0)
        opt.step()
        schedule.step()
        step += 1
        if step % eval_every == 0 or step == steps:
            evals.append(evaluate(pipe, eval_data))
        bar.update(1)
        bar.set_postfix(loss=f"{float(loss) * accumulate:.3f}", norm=f"{float(norm):.2f}", eval=f"{evals[-1]:.3f}",
                        tok_s=f"{tokens / (time.perf_counter() - start):,.0f}")
    bar.close()
    if pipe.rank == 0:
        print(f"trained {steps} steps on {tokens} tokens ({short} short batches)", flush=True)
    return evals


def evaluate(pipe: Any, data: Windows, batches: int = 4) -> float:
    """The mean loss of the first few evaluation batches, in eval mode (no autograd graph)."""
    pipe.eval()
    losses = [float(pipe.evaluate((x,), y)) for (x, y), _ in zip(loader(data, shuffle=False), range(batches))]
    pipe.train()
    return sum(losses) / len(losses)


def _epochs(data: Windows) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Batches for ever: each epoch shuffled anew (its seed is its number), the last batch short."""
    epoch = 0
    while True:
        yield from loader(data, shuffle=True, seed=epoch)
        epoch += 1


def _progress(steps: int, show: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=steps, desc="train", disable=not show, file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Train the compiled character-level GPT (under torchrun).")
    parser.add_argument("dir", help="the package: python -m partitioner compile examples/train_gpt.py --out DIR")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--accumulate", type=int, default=2, help="train_step calls per optimizer step")
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--lr", type=float, default=3e-3)
    ns = parser.parse_args(argv)
    evals = train(ns.dir, ns.steps, ns.accumulate, ns.eval_every, ns.lr)
    if int(os.environ.get("RANK", "0")) == 0:
        print("eval loss: " + " ".join(f"{e:.4f}" for e in evals), flush=True)
    # every rank done, then the process group closed: left to the interpreter's exit, gloo's
    # threads were sometimes torn down joinable and the process aborted after training
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
