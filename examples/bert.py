"""A BERT-like encoder in plain PyTorch: token + position + token-type embeddings with
LayerNorm, N post-LayerNorm bidirectional self-attention blocks (attention, add & norm,
feed-forward, add & norm), and a classification head (tanh pooler + linear) on the first
token. Trained with cross-entropy on NUM_LABELS classes. torch.fx-traceable: no
data-dependent Python control flow, no dropout."""

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH = 24
SEQ = 8
VOCAB = 64
HIDDEN = 32
N_HEAD = 4
N_LAYER = 6
NUM_LABELS = 3
MAX_POS = 16


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n_head = N_HEAD
        self.head_dim = HIDDEN // N_HEAD
        self.query = nn.Linear(HIDDEN, HIDDEN)
        self.key = nn.Linear(HIDDEN, HIDDEN)
        self.value = nn.Linear(HIDDEN, HIDDEN)
        self.out = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q = self.query(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.key(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        v = self.value(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v)  # bidirectional: no mask
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.out(y)


class EncoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = SelfAttention()
        self.ln_attn = nn.LayerNorm(HIDDEN)
        self.intermediate = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.output = nn.Linear(4 * HIDDEN, HIDDEN)
        self.ln_out = nn.LayerNorm(HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_attn(x + self.attention(x))  # post-LN
        x = self.ln_out(x + self.output(F.gelu(self.intermediate(x))))
        return x


class Bert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.position_embeddings = nn.Embedding(MAX_POS, HIDDEN)
        self.token_type_embeddings = nn.Embedding(2, HIDDEN)
        self.ln_emb = nn.LayerNorm(HIDDEN)
        self.layers = nn.ModuleList(EncoderLayer() for _ in range(N_LAYER))
        self.pooler = nn.Linear(HIDDEN, HIDDEN)
        self.classifier = nn.Linear(HIDDEN, NUM_LABELS)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        T = input_ids.size(1)
        pos = torch.arange(0, T, dtype=torch.long, device=input_ids.device)
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(pos)
            + self.token_type_embeddings(token_type_ids)
        )
        x = self.ln_emb(x)
        for layer in self.layers:
            x = layer(x)
        pooled = torch.tanh(self.pooler(x[:, 0]))
        return self.classifier(pooled)


def build_model() -> nn.Module:
    return Bert()


def example_inputs():
    g = torch.Generator().manual_seed(1234)
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    # sentence A is the first half, sentence B the second half
    token_type_ids = (torch.arange(SEQ) >= SEQ // 2).long().expand(BATCH, SEQ).contiguous()
    return (input_ids, token_type_ids)


def example_target():
    g = torch.Generator().manual_seed(4321)
    return torch.randint(0, NUM_LABELS, (BATCH,), generator=g)


def loss_fn(output, target):
    return F.cross_entropy(output, target)
