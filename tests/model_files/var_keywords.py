# A VALID model file whose forward takes `**kwargs`, given a mask and a scale by keyword.
"""A three-layer MLP `forward(x, **kwargs)`: `kwargs["mask"]` (B, 16) and `kwargs["scale"]`, a float."""

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH, D = 8, 6


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, 16)
        self.b = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x, **kwargs):
        h = torch.tanh(self.a(x)) * kwargs["mask"]  # (B, 16)
        h = torch.tanh(self.b(h)) * kwargs.get("scale", 1.0)
        return self.head(h)


def build_model():
    return Net()


def example_inputs():
    g = torch.Generator().manual_seed(11)
    return {"x": torch.randn(BATCH, D, generator=g), "mask": (torch.rand(BATCH, 16, generator=g) > 0.3).float(),
            "scale": 0.5}


def example_target():
    return torch.randint(0, 3, (BATCH,), generator=torch.Generator().manual_seed(12))


def loss_fn(output, target):
    return F.cross_entropy(output, target)
