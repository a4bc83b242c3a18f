"""Dropout (a module and the functional form with `self.training`) and batch norm, for the
train / eval mode tests: the output is itself a dropout's, so its zeros count the mask; batch
norm comes before the dropouts, so its running statistics do not depend on the masks."""

import torch
import torch.nn.functional as F
from torch import nn

BATCH, D, OUT = 32, 16, 8


class DropNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, 64)
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(64, 64)
        self.bn = nn.BatchNorm1d(64)
        self.fc3 = nn.Linear(64, OUT)
        self.drop_out = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.fc2(torch.relu(self.fc1(x)))))  # batch norm before any dropout
        h = F.dropout(self.drop(h), 0.2, self.training)
        return self.drop_out(self.fc3(h))


def build_model() -> nn.Module:
    return DropNet()


def example_inputs() -> tuple[torch.Tensor]:
    return (torch.randn(BATCH, D, generator=torch.Generator().manual_seed(1)),)


def example_target() -> torch.Tensor:
    return torch.randn(BATCH, OUT, generator=torch.Generator().manual_seed(2))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)
