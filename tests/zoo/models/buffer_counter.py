"""A buffer rebound in forward (`self.steps += 1`) and read after: torch.export records an
`add_` first and a `copy_` back into the buffer at the end of the graph, which must stay on
the buffer's one stage with every node that reads it."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class BufferCounter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 8)
        self.fc3 = nn.Linear(8, 2)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        self.steps += 1
        h = torch.relu(self.fc1(x * self.steps))
        return self.fc3(torch.relu(self.fc2(h)))


def build_model():
    return BufferCounter()


def example_inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(8, 4, generator=g),)


def example_target():
    return torch.zeros(8, 2)


def loss_fn(output, target):
    return F.mse_loss(output, target)
