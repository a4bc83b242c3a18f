# A VALID model file whose forward returns a Hugging Face ModelOutput subclass defined here.
"""A three-layer MLP returning `Out(logits=..., hidden=...)`, a `ModelOutput` (`loss` unset)."""

import dataclasses
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.utils import ModelOutput

BATCH, D = 8, 6


@dataclasses.dataclass
class Out(ModelOutput):
    loss: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None
    hidden: Optional[torch.Tensor] = None


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, 16)
        self.b = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = torch.tanh(self.b(torch.tanh(self.a(x))))  # (B, 16)
        return Out(logits=self.head(h), hidden=h)


def build_model():
    return Net()


def example_inputs():
    return (torch.randn(BATCH, D, generator=torch.Generator().manual_seed(11)),)


def example_target():
    return torch.randint(0, 3, (BATCH,), generator=torch.Generator().manual_seed(12))


def loss_fn(output, target):
    assert isinstance(output, Out), f"loss_fn got {type(output)}"
    return F.cross_entropy(output.logits, target) + 0.1 * output["hidden"].pow(2).mean()
