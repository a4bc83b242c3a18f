"""An MLP of about 0.5 GB of float32 weights (8 layers of 4096 x 4096 and their biases), for
benchmarks/checkpoint_io.py: big enough that writing and reading it takes measurable time and
memory, small enough for a 24 GiB machine to hold four ranks and a baseline."""

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH, WIDTH, LAYERS = 8, 4096, 8


class HalfGbMlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.relu(layer(x))
        return x


def build_model() -> nn.Module:
    return HalfGbMlp()


def example_inputs():
    return (torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1)),)


def example_target():
    return torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(2))


def loss_fn(output, target):
    return F.mse_loss(output, target)
