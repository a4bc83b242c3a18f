# BREAKS: forward() has data-dependent Python control flow (`if x.sum() > 0:`), which
# torch.fx cannot trace (a Proxy has no bool) and torch.export cannot trace either
# (a data-dependent guard on a tensor value).
import torch
import torch.nn as nn
import torch.nn.functional as F


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x):
        h = self.fc1(x)
        if h.sum() > 0:
            h = F.relu(h)
        else:
            h = -h
        return self.fc2(h)


def build_model():
    return DataDependent()


def example_inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(8, 4, generator=g),)


def example_target():
    return torch.zeros(8, 2)


def loss_fn(output, target):
    return F.mse_loss(output, target)
