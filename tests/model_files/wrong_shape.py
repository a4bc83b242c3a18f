# BREAKS: example_inputs() gives a (8, 5) tensor but the first Linear (fc1) expects 4
# features, so running the model on the example batch fails with a shape mismatch at the
# `self.fc1(x)` line of forward() below.
import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x):
        h = F.relu(self.fc1(x))
        return self.fc2(h)


def build_model():
    return Net()


def example_inputs():
    return (torch.zeros(8, 5),)


def example_target():
    return torch.zeros(8, 2)


def loss_fn(output, target):
    return F.mse_loss(output, target)
