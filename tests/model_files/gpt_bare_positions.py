"""A small GPT whose learned positions are one bare `nn.Parameter` of the model itself, and
whose `init_weights(module)` covers only that parameter: every other module (embedding,
LayerNorm, Linear) is left to its own `reset_parameters()`. The head is tied to the token
embedding."""

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH, T, D, V = 8, 8, 32, 64


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc = nn.Linear(D, 4 * D)
        self.proj = nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(F.gelu(self.fc(self.ln(x))))


class BarePositions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.pos = nn.Parameter(torch.zeros(T, D))
        self.blocks = nn.Sequential(*(Block() for _ in range(3)))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(self.blocks(self.tok(idx) + self.pos)))


def init_weights(module: nn.Module) -> None:
    if isinstance(module, BarePositions):
        nn.init.normal_(module.pos, std=0.02)


def build_model() -> nn.Module:
    return BarePositions()


def example_inputs() -> tuple[torch.Tensor]:
    return (torch.randint(0, V, (BATCH, T), generator=torch.Generator().manual_seed(0)),)


def example_target() -> torch.Tensor:
    return torch.randint(0, V, (BATCH, T), generator=torch.Generator().manual_seed(1))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, 1), target.flatten())
