# A VALID model file (nothing broken): a tiny 4-layer MLP (16 -> 32 -> 32 -> 16 -> 4, ReLU),
# whole batch 8, cross-entropy on 4 classes. For CLI tests.
"""A tiny 4-layer MLP for command-line tests."""

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH = 8


def build_model():
    return nn.Sequential(
        nn.Linear(16, 32),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.ReLU(),
        nn.Linear(32, 16),
        nn.ReLU(),
        nn.Linear(16, 4),
    )


def example_inputs():
    g = torch.Generator().manual_seed(1234)
    return (torch.randn(BATCH, 16, generator=g),)


def example_target():
    g = torch.Generator().manual_seed(4321)
    return torch.randint(0, 4, (BATCH,), generator=g)


def loss_fn(output, target):
    return F.cross_entropy(output, target)
