"""A two-layer LSTM with dropout 0.3 between its layers, between two linears, for the
eval-mode tests (tests/runtime/test_eval_modes.py)."""

import torch
import torch.nn.functional as F
from torch import nn

BATCH, SEQ, D, H = 8, 6, 12, 16


class LstmNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, H)
        self.lstm = nn.LSTM(H, H, num_layers=2, dropout=0.3, batch_first=True)
        self.out = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(torch.tanh(self.inp(x)))
        return self.out(h)


def build_model() -> nn.Module:
    return LstmNet()


def example_inputs() -> tuple[torch.Tensor]:
    return (torch.randn(BATCH, SEQ, D, generator=torch.Generator().manual_seed(1)),)


def example_target() -> torch.Tensor:
    return torch.randn(BATCH, SEQ, D, generator=torch.Generator().manual_seed(2))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)
