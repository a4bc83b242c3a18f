"""Two residual MLP blocks whose hidden activations outweigh their parameters, and a small
head: split in two, each pipeline stage holds one block's activations for every
microbatch under GPipe, and no other split holds less (the offloading tests)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

WIDTH, HIDDEN, BATCH, CLASSES = 16, 256, 256, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))  # saves (B, HIDDEN) twice


class TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model() -> nn.Module:
    return TwoBlocks()


def example_inputs():
    return (torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1)),)


def example_target():
    return torch.randint(0, CLASSES, (BATCH,), generator=torch.Generator().manual_seed(2))


def loss_fn(out, target):
    return F.cross_entropy(out, target)
