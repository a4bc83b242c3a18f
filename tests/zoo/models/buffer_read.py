"""A buffer read in forward (`self.cval.clone()`), a tensor default argument, and a
buffer updated in place: values must come from the stage's buffers, not the compile."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class BufferRead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 2)
        self.register_buffer("cval", torch.full((8,), 0.5))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x, shift=torch.tensor(0.25)):
        self.steps.add_(1)
        h = self.fc1(x) * self.cval.clone() + shift
        return self.fc2(torch.relu(h))


def build_model():
    return BufferRead()


def example_inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(8, 4, generator=g),)


def example_target():
    return torch.zeros(8, 2)


def loss_fn(output, target):
    return F.mse_loss(output, target)
