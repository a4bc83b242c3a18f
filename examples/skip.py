"""A U-Net-like MLP with long skip connections: an encoder of 4 Linear+GELU layers narrowing
64 -> 128 -> 96 -> 64 -> 32, a bottleneck layer, and a mirrored decoder whose layers each read
the matching encoder activation again (alternately concatenated and added), so the output of
encoder layer 1 is read again by the last decoder layer. MSE loss against a fixed target."""

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH = 24
IN = 64
ENC = (128, 96, 64, 32)


class SkipNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        e1, e2, e3, e4 = ENC
        self.enc1 = nn.Linear(IN, e1)
        self.enc2 = nn.Linear(e1, e2)
        self.enc3 = nn.Linear(e2, e3)
        self.enc4 = nn.Linear(e3, e4)
        self.bottleneck = nn.Linear(e4, e4)
        self.dec4 = nn.Linear(2 * e4, e3)  # cat(bottleneck, h4)
        self.dec3 = nn.Linear(e3, e2)  # dec4 + h3 (add)
        self.dec2 = nn.Linear(2 * e2, e1)  # cat(dec3, h2)
        self.dec1 = nn.Linear(e1, IN)  # dec2 + h1 (add)
        self.head = nn.Linear(2 * IN, IN)  # cat(dec1, x): the input itself, read at the end

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h1 = F.gelu(self.enc1(x))
        h2 = F.gelu(self.enc2(h1))
        h3 = F.gelu(self.enc3(h2))
        h4 = F.gelu(self.enc4(h3))
        b = F.gelu(self.bottleneck(h4))
        d = F.gelu(self.dec4(torch.cat([b, h4], dim=-1)))
        d = F.gelu(self.dec3(d + h3))
        d = F.gelu(self.dec2(torch.cat([d, h2], dim=-1)))
        d = F.gelu(self.dec1(d + h1))
        return self.head(torch.cat([d, x], dim=-1))


def build_model() -> nn.Module:
    return SkipNet()


def example_inputs():
    g = torch.Generator().manual_seed(1234)
    return (torch.randn(BATCH, IN, generator=g),)


def example_target():
    g = torch.Generator().manual_seed(4321)
    return torch.randn(BATCH, IN, generator=g)


def loss_fn(output, target):
    return F.mse_loss(output, target)
