"""An MLP block with two dropouts, for the tensor-parallel dropout streams ([Note: dropout
streams] in runtime/modes.py): under tp = 2 fc1 is column-parallel, so the first dropout
drops a sharded value, and fc2 row-parallel, so the second drops a replicated one.  The
model returns both dropouts' outputs (the first made whole), so their zeros show the masks."""

import torch
import torch.nn.functional as F
from torch import nn

BATCH, D, H = 16, 1024, 4096


class DropMlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, H)
        self.fc2 = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = F.dropout(torch.relu(self.fc1(x)) + 1.0, 0.5, self.training)  # + 1: a zero is a dropped element
        y = F.dropout(self.fc2(h) + 1.0, 0.5, self.training)
        return y, h


def build_model() -> nn.Module:
    return DropMlp()


def example_inputs() -> tuple[torch.Tensor]:
    return (torch.randn(BATCH, D, generator=torch.Generator().manual_seed(1)),)


def example_target() -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.zeros(BATCH, D), torch.zeros(BATCH, H))


def loss_fn(output: tuple[torch.Tensor, torch.Tensor], target: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(output[0], target[0]) + F.mse_loss(output[1], target[1])
