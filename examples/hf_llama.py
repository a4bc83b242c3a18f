"""Hugging Face `transformers.LlamaForCausalLM` from a tiny LlamaConfig (4 layers, hidden 32,
4 heads with 2 key/value heads (GQA), intermediate 64, vocab 96, 16 positions, RoPE, RMSNorm,
SiLU MLP, untied lm_head, no dropout, no KV cache), returned unchanged. Inputs are keyword
arguments ({"input_ids": ...}); the loss is next-token cross-entropy on `output.logits`."""

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

BATCH = 24
SEQ = 8
VOCAB = 96

CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=16,
    attention_dropout=0.0,
    bos_token_id=VOCAB - 2,
    eos_token_id=VOCAB - 1,
    pad_token_id=VOCAB - 1,
    tie_word_embeddings=False,
    use_cache=False,
)


def build_model():
    return LlamaForCausalLM(LlamaConfig(**CONFIG))


def _tokens():
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, VOCAB - 2, (BATCH, SEQ + 1), generator=g)


def example_inputs():
    return {"input_ids": _tokens()[:, :-1].contiguous()}


def example_target():
    return _tokens()[:, 1:].contiguous()


def loss_fn(output, target):
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))
