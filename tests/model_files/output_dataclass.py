# A VALID model file whose forward returns a @dataclass defined here, holding another.
"""A three-layer MLP returning `Out(logits, extra=Extra(hidden, norm))`."""

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH, D = 8, 6


@dataclasses.dataclass
class Extra:
    hidden: torch.Tensor
    norm: torch.Tensor


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    extra: Extra


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, 16)
        self.b = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = torch.tanh(self.b(torch.tanh(self.a(x))))  # (B, 16)
        return Out(self.head(h), Extra(h, h.norm(dim=-1)))


def build_model():
    return Net()


def example_inputs():
    return (torch.randn(BATCH, D, generator=torch.Generator().manual_seed(11)),)


def example_target():
    return torch.randint(0, 3, (BATCH,), generator=torch.Generator().manual_seed(12))


def loss_fn(output, target):
    assert isinstance(output, Out) and isinstance(output.extra, Extra), f"loss_fn got {output!r:.80}"
    return F.cross_entropy(output.logits, target) + 0.1 * output.extra.norm.mean()
