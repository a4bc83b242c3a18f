"""Batch norm between two linears, no dropout: with several microbatches each normalises by,
and updates the running statistics with, its own mean and variance (tests/runtime/test_modes.py)."""

import torch
import torch.nn.functional as F
from torch import nn

BATCH, D, H = 32, 16, 64


class BnNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, H)
        self.bn = nn.BatchNorm1d(H)
        self.fc2 = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def build_model() -> nn.Module:
    return BnNet()


def example_inputs() -> tuple[torch.Tensor]:
    return (torch.randn(BATCH, D, generator=torch.Generator().manual_seed(1)),)


def example_target() -> torch.Tensor:
    return torch.randn(BATCH, D, generator=torch.Generator().manual_seed(2))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)
