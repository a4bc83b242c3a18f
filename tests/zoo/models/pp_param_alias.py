"""After PyTorch's pipelining test zoo, re-created: one parameter reachable under two names
(an alias) and read in two places."""
import torch
import torch.nn as nn
import torch.nn.functional as F

D = 16


class ModelWithParamAlias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mm_param0 = nn.Parameter(torch.randn(D, D) / 4)
        self.mm_param1 = self.mm_param0
        self.lin0 = nn.Linear(D, D)
        self.lin1 = nn.Linear(D, D)

    def forward(self, x):
        x = torch.relu(torch.mm(x, self.mm_param0))
        x = torch.relu(self.lin0(x))
        x = torch.mm(x, self.mm_param1)
        return self.lin1(x)


def build_model():
    return ModelWithParamAlias()


def example_inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(8, D, generator=g),)


def example_target():
    return torch.zeros(8, D)


def loss_fn(output, target):
    return F.mse_loss(output, target)
