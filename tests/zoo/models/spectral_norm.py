"""`torch.nn.utils.spectral_norm`: each forward in train mode runs a power iteration under
`torch.no_grad()` with `out=` ops, updating its `weight_u` / `weight_v` buffers, and
divides the weight by the estimated largest singular value."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class SpectralNormMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.utils.spectral_norm(nn.Linear(4, 16))
        self.fc2 = nn.utils.spectral_norm(nn.Linear(16, 16))
        self.fc3 = nn.Linear(16, 2)

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def build_model():
    torch.manual_seed(0)
    return SpectralNormMLP()


def example_inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(8, 4, generator=g),)


def example_target():
    return torch.zeros(8, 2)


def loss_fn(output, target):
    return F.mse_loss(output, target)
