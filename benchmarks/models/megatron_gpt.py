"""The GPT of Megatron-LM's weak-scaling table (Narayanan et al., SC'21, table 1): token
embedding and learned positions, pre-LayerNorm blocks with a fused qkv projection and causal
attention computed as Megatron-LM computed it in 2021, a GELU MLP of 4h, a final LayerNorm
and an untied head; vocabulary 51200, sequence 2048, in bfloat16.  For planning with
`--analytic` (meta device).

The attention is not `F.scaled_dot_product_attention` (which an A100 runs as one fused flash
kernel, 2022): Megatron-LM's runs wrote the scores q k^T of every head to memory, read them
back through its fused scale-mask-softmax kernel and multiplied the probabilities by v, as
here.  Those passes over heads x seq^2 scores per layer cost the small models most (heads
per GPU x seq against h^2 / tp of matmul work: 24 heads at h 2304 on one GPU for the 1.7B
row, 16 per GPU at h 20480 for the 530B).  The mask is added as a bias here, a pass that
Megatron-LM's kernel fused into its softmax; its dropout on the probabilities (0.1), a pass
of about the same bytes, is left out.

The size comes from the environment, so that one file serves every row of the table:
MEG_H (hidden), MEG_L (layers), MEG_HEADS, MEG_B (global batch), MEG_SEQ, MEG_VOCAB.
Without them it is a small model of row 6's shape (its head a third of a layer's FLOPs).

Used by benchmarks/published.py and tests/partitioner/test_virtual_stages.py.
"""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

H = int(os.environ.get("MEG_H", 1024))
LAYERS = int(os.environ.get("MEG_L", 16))
HEADS = int(os.environ.get("MEG_HEADS", 16))
BATCH = int(os.environ.get("MEG_B", 64))
SEQ = int(os.environ.get("MEG_SEQ", 128))
VOCAB = int(os.environ.get("MEG_VOCAB", 4096))
DTYPE = torch.bfloat16


def causal_mask(t: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(t, t): 0 where a position may attend, -inf after it."""
    return torch.full((t, t), float("-inf"), device=device, dtype=dtype).triu(1)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.qkv, self.proj = nn.Linear(H, 3 * H), nn.Linear(H, H)
        self.fc, self.out = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(H, dim=2)
        q, k, v = (z.view(b, t, HEADS, H // HEADS).transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hs)
        scores = (q * (H // HEADS) ** -0.5) @ k.transpose(-2, -1) + causal_mask(t, x.device, x.dtype)
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, H)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, H), nn.Embedding(SEQ, H)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f, self.head = nn.LayerNorm(H), nn.Linear(H, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))  # (B, T, H)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, T, vocab)


def build_model() -> nn.Module:
    return GPT().to(DTYPE)


def example_inputs() -> tuple[torch.Tensor]:
    return (torch.zeros(BATCH, SEQ, dtype=torch.long),)


def example_target() -> torch.Tensor:
    return torch.zeros(BATCH, SEQ, dtype=torch.long)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.size(-1)).float(), target.reshape(-1))
