"""After PyTorch's pipelining test zoo (test/distributed/pipelining/model_registry.py),
re-created: raw matmuls with parameters, a buffer added to the activations, two Linears."""
import torch
import torch.nn as nn
import torch.nn.functional as F

D = 16


class ExampleCode(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mm_param0 = nn.Parameter(torch.randn(D, D) / 4)
        self.mm_param1 = nn.Parameter(torch.randn(D, D) / 4)
        self.register_buffer("cval", torch.randn(D))
        self.lin0 = nn.Linear(D, D)
        self.lin1 = nn.Linear(D, D)

    def forward(self, x):
        x = torch.relu(torch.mm(x, self.mm_param0))
        a = torch.mm(x, self.mm_param1)
        x = torch.relu(self.lin0(x)) + a
        x = x + self.cval
        return torch.relu(self.lin1(torch.mm(x, self.mm_param1)))


def build_model():
    return ExampleCode()


def example_inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(8, D, generator=g),)


def example_target():
    return torch.zeros(8, D)


def loss_fn(output, target):
    return F.mse_loss(output, target)
