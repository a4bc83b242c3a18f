"""InstanceNorm1d with running statistics (track_running_stats=True) between two linears,
for the eval-mode tests (tests/runtime/test_eval_modes.py): in train mode it normalises by
each sample's statistics, in eval mode by the running ones."""

import torch
import torch.nn.functional as F
from torch import nn

BATCH, C, L = 8, 6, 10


class InstanceNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(L, L)
        self.norm = nn.InstanceNorm1d(C, affine=True, track_running_stats=True)
        self.fc2 = nn.Linear(L, L)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def build_model() -> nn.Module:
    model = InstanceNet()
    with torch.no_grad():  # running statistics far from a batch's, so that eval mode differs from train mode
        model.norm.running_mean.uniform_(-1.0, 1.0)
        model.norm.running_var.uniform_(0.5, 2.0)
    return model


def example_inputs() -> tuple[torch.Tensor]:
    return (torch.randn(BATCH, C, L, generator=torch.Generator().manual_seed(1)),)


def example_target() -> torch.Tensor:
    return torch.randn(BATCH, C, L, generator=torch.Generator().manual_seed(2))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)
