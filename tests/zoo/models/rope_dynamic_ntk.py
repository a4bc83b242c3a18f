"""A small decoder whose rotary embedding is dynamic NTK written by hand (as Hugging Face wrote it
before `dynamic_rope_update`): past `max_position_embeddings` (4, the batch has 8 positions) its
forward recomputes `inv_freq` with a scaled base and re-registers the buffer, so it is kept whole
(`if seq_len > ...` on a tensor) and the stage must hold the rebound buffer from then on."""
import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH, SEQ, VOCAB, DIM, HEADS = 4, 8, 64, 32, 4
MAX_POS = 4


class DynamicNTKRotary(nn.Module):
    def __init__(self, dim, max_position_embeddings, base=10000.0, scaling_factor=2.0):
        super().__init__()
        self.dim, self.base, self.scaling_factor = dim, base, scaling_factor
        self.original_max_seq_len = self.max_seq_len_cached = max_position_embeddings
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.original_inv_freq = inv_freq

    def forward(self, x, position_ids):
        seq_len = torch.max(position_ids) + 1
        if seq_len > self.max_seq_len_cached:
            base = self.base * ((self.scaling_factor * seq_len / self.original_max_seq_len) - (self.scaling_factor - 1)) ** (self.dim / (self.dim - 2))
            inv_freq = 1.0 / (base ** (torch.arange(0, self.dim, 2, dtype=torch.int64).float() / self.dim))
            self.register_buffer("inv_freq", inv_freq, persistent=False)
            self.max_seq_len_cached = seq_len
        if seq_len < self.original_max_seq_len and self.max_seq_len_cached > self.original_max_seq_len:
            self.register_buffer("inv_freq", self.original_inv_freq, persistent=False)
            self.max_seq_len_cached = self.original_max_seq_len
        freqs = position_ids[:, :, None].float() * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        cos, sin = cos[:, None], sin[:, None]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, DIM))
        return x + self.mlp(x)


class Decoder(nn.Module):
    def __init__(self, max_pos=MAX_POS):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.rotary = DynamicNTKRotary(DIM // HEADS, max_pos)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand(input_ids.shape[0], -1)
        cos, sin = self.rotary(x, position_ids)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(x)


def build_model():
    return Decoder()


def tokens():
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, VOCAB - 1, (BATCH, SEQ + 1), generator=g)


def example_inputs():
    return (tokens()[:, :-1].contiguous(),)


def example_target():
    return tokens()[:, 1:].contiguous()


def loss_fn(output, target):
    return F.cross_entropy(output.reshape(-1, VOCAB), target.reshape(-1))
