"""RReLU (a random negative slope in train mode, the mean slope in eval mode) between two
linears, for the eval-mode tests (tests/runtime/test_eval_modes.py)."""

import torch
import torch.nn.functional as F
from torch import nn

BATCH, D = 16, 12


class RreluNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, D)
        self.act = nn.RReLU()
        self.fc2 = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def build_model() -> nn.Module:
    return RreluNet()


def example_inputs() -> tuple[torch.Tensor]:
    return (torch.randn(BATCH, D, generator=torch.Generator().manual_seed(1)),)


def example_target() -> torch.Tensor:
    return torch.randn(BATCH, D, generator=torch.Generator().manual_seed(2))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)
