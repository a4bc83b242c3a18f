"""After PyTorch's pipelining test zoo, re-created: a stack of MLP blocks, the usual unit of a
manual split."""
import torch
import torch.nn as nn
import torch.nn.functional as F

D = 16


class MLPModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(D, 2 * D)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(2 * D, D)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


class MultiMLP(nn.Module):
    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MLPModule() for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def build_model():
    return MultiMLP()


def example_inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(8, D, generator=g),)


def example_target():
    return torch.zeros(8, D)


def loss_fn(output, target):
    return F.mse_loss(output, target)
