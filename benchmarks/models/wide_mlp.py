"""Transformer-style MLP blocks, wide enough that splitting a matmul pays on the CPU:
`x + W2 gelu(W1 layernorm(x))` four times on (B, T, 512) with a 2048-wide hidden layer.

Used by benchmarks/mesh_search.py: a model where pipeline stages, tensor parallelism and
data parallelism each have a case (TP halves the big matmuls for one all_reduce of a
(B, T, 512) activation per block; DP all-reduces 8 MiB of gradients per block; PP pays
its bubble), so which mesh is fastest is a real question.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH, SEQ, WIDTH, HIDDEN, BLOCKS, CLASSES = 16, 8, 512, 2048, 4, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.ln(x))))


class WideMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=1))


def build_model() -> nn.Module:
    return WideMLP()


def example_inputs():
    g = torch.Generator().manual_seed(1234)
    return (torch.randn(BATCH, SEQ, WIDTH, generator=g),)


def example_target():
    g = torch.Generator().manual_seed(4321)
    return torch.randint(0, CLASSES, (BATCH,), generator=g)


def loss_fn(output, target):
    return F.cross_entropy(output, target)
