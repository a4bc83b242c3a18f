"""A pyramid MLP: 64 -> 256 -> 512 -> 256 -> 128 -> 64 -> 10 with GELU, trained with
cross-entropy on 10 classes. The layers have deliberately uneven widths (so uneven cost)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH = 24
WIDTHS = (64, 256, 512, 256, 128, 64, 10)
NUM_CLASSES = WIDTHS[-1]


class PyramidMLP(nn.Module):
    def __init__(self, widths=WIDTHS) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Linear(i, o) for i, o in zip(widths[:-1], widths[1:])
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = len(self.layers)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < n - 1:
                x = F.gelu(x)
        return x


def build_model() -> nn.Module:
    return PyramidMLP()


def example_inputs():
    g = torch.Generator().manual_seed(1234)
    return (torch.randn(BATCH, WIDTHS[0], generator=g),)


def example_target():
    g = torch.Generator().manual_seed(4321)
    return torch.randint(0, NUM_CLASSES, (BATCH,), generator=g)


def loss_fn(output, target):
    return F.cross_entropy(output, target)
