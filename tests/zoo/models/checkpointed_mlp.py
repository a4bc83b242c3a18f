"""A plain MLP whose blocks run under torch.utils.checkpoint, called as user code does:
`torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)`, and through a name
imported at import time with `use_reentrant=False` and a keyword argument."""
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x, scale=1.0):
        return x + scale * self.down(F.gelu(self.up(x)))


class Net(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(4))
        self.out = nn.Linear(width, 4)

    def forward(self, x):
        h = self.inp(x)
        h = torch.utils.checkpoint.checkpoint(self.blocks[0], h, use_reentrant=True)
        h = torch.utils.checkpoint.checkpoint(lambda t: self.blocks[1](torch.tanh(t)), h, use_reentrant=True)
        h = checkpoint(self.blocks[2], h, use_reentrant=False, scale=0.5)
        h = self.blocks[3](h)
        return self.out(h)


def build_model():
    return Net()


def example_inputs():
    return (torch.randn(8, 8, generator=torch.Generator().manual_seed(0)),)


def example_target():
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(1))


def loss_fn(output, target):
    return F.mse_loss(output, target)
