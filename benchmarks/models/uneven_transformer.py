"""A decoder whose blocks differ: the MLP width grows block by block and the vocabulary is
large, so neither equal layers nor equal parameters balance the compute.

Used by benchmarks/partition_quality.py.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

D, HEADS, T, VOCAB, BATCH = 128, 4, 32, 2048, 32
MLP_WIDTHS = [128, 256, 512, 1024, 1024, 2048, 2048, 4096]


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc, self.out = nn.Linear(D, hidden), nn.Linear(hidden, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)
        q, k, v = (z.view(b, t, HEADS, D // HEADS).transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, D)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class UnevenGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(T, D)
        self.blocks = nn.ModuleList(Block(h) for h in MLP_WIDTHS)
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model() -> nn.Module:
    return UnevenGPT()


def example_inputs() -> tuple[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, VOCAB, (BATCH, T), generator=g),)


def example_target() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (BATCH, T), generator=g)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, 1), target.flatten())
