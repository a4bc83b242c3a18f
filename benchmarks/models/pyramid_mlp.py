"""A pyramid MLP: every layer is wider than the last, so equal-layer splits are badly
unbalanced (a layer's cost grows with the square of its width).

Used by benchmarks/partition_quality.py.  Eleven Linear+GELU layers whose cost ranges over
three orders of magnitude; the batch is big enough that every layer's matmul dominates
its Python overhead.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

WIDTHS = [64, 128, 256, 512, 768, 1024, 1536, 2048, 2560, 3072, 3584, 10]
BATCH = 128


class PyramidMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(WIDTHS[:-1], WIDTHS[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = F.gelu(layer(x))
        return self.layers[-1](x)


def build_model() -> nn.Module:
    return PyramidMLP()


def example_inputs() -> tuple[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(BATCH, WIDTHS[0], generator=g),)


def example_target() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, WIDTHS[-1], (BATCH,), generator=g)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)
