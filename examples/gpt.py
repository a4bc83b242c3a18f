"""A nanoGPT-like decoder-only transformer in plain PyTorch: token + position embedding,
N blocks of pre-LayerNorm causal self-attention + MLP, a final LayerNorm and an lm_head whose
weight is tied to the token embedding. Trained on next-token prediction (cross-entropy over
B*T tokens). Written to be torch.fx-traceable: no data-dependent Python control flow.

The size is set by `GPTConfig`; `build_model(config)` takes one (default: the small config)."""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH = 24


@dataclass
class GPTConfig:
    n_layer: int = 4
    n_embd: int = 32
    n_head: int = 4
    vocab_size: int = 64
    block_size: int = 8  # maximum (and example) sequence length


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0
        self.n_head = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        return self.lm_head(x)  # (B, T, vocab) logits


def build_model(config: GPTConfig | None = None) -> nn.Module:
    return GPT(config if config is not None else GPTConfig())


def _tokens(seed: int, cfg: GPTConfig):
    g = torch.Generator().manual_seed(seed)
    # one sequence of block_size + 1 tokens per row: inputs are [:-1], targets are [1:]
    return torch.randint(0, cfg.vocab_size, (BATCH, cfg.block_size + 1), generator=g)


def example_inputs(config: GPTConfig | None = None):
    cfg = config if config is not None else GPTConfig()
    return (_tokens(1234, cfg)[:, :-1].contiguous(),)


def example_target(config: GPTConfig | None = None):
    cfg = config if config is not None else GPTConfig()
    return _tokens(1234, cfg)[:, 1:].contiguous()


def loss_fn(output, target):
    return F.cross_entropy(output.reshape(-1, output.size(-1)), target.reshape(-1))
