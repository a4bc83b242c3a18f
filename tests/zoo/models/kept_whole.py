"""A submodule with data-dependent Python control flow (a NaN guard, `if torch.isfinite(h).all():`)
inside a larger model: neither tracer can trace it, so it is kept whole, placed on one stage,
run as written.  (A branch on a batch statistic would decide per microbatch.)"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        h = self.fc(x)
        if torch.isfinite(h).all():
            h = F.relu(h)
        else:
            h = torch.zeros_like(h)
        return self.norm(h + x)


class WithGate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 16)
        self.blocks = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))
        self.gate = Gate()
        self.out = nn.Linear(16, 2)

    def forward(self, x):
        return self.out(self.gate(self.blocks(self.inp(x))))


def build_model():
    return WithGate()


def example_inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(8, 4, generator=g),)


def example_target():
    return torch.zeros(8, 2)


def loss_fn(output, target):
    return F.mse_loss(output, target)
