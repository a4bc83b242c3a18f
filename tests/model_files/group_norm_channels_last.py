"""Two convolutions, each followed by a GroupNorm, on channels_last activations (as a
SegFormer-style vision model runs them).  torch's CPU group norm backward dies (SIGSEGV)
when asked for its weight and bias gradients alone on such an input, which profiling's
weight-gradient timing and a zero-bubble schedule's W both ask of it
([Note: a weight-only group norm backward] in runtime/split_backward.py)."""

import torch
import torch.nn.functional as F
from torch import nn

BATCH, CLASSES = 8, 4


class GroupNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.norm1 = nn.GroupNorm(4, 8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.norm2 = nn.GroupNorm(2, 8)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous(memory_format=torch.channels_last)
        x = F.gelu(self.norm1(self.conv1(x)))
        x = F.gelu(self.norm2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


def build_model() -> nn.Module:
    return GroupNormNet()


def example_inputs() -> tuple[torch.Tensor]:
    return (torch.randn(BATCH, 3, 8, 8, generator=torch.Generator().manual_seed(0)),)


def example_target() -> torch.Tensor:
    return torch.randint(0, CLASSES, (BATCH,), generator=torch.Generator().manual_seed(1))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)
