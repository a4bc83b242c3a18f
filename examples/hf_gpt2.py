"""Hugging Face `transformers.GPT2LMHeadModel` from a tiny GPT2Config (4 layers, n_embd 32,
4 heads, vocab 96, 16 positions, all dropout 0, no KV cache), returned unchanged. Inputs are
keyword arguments ({"input_ids": ...}); the output is a CausalLMOutputWithCrossAttentions and
the loss is next-token cross-entropy on `output.logits`. torch.fx.symbolic_trace cannot trace
this model (HF control flow); torch.export can."""

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

BATCH = 24
SEQ = 8
VOCAB = 96

CONFIG = dict(
    vocab_size=VOCAB,
    n_positions=16,
    n_embd=32,
    n_layer=4,
    n_head=4,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
    summary_first_dropout=0.0,
    bos_token_id=VOCAB - 1,
    eos_token_id=VOCAB - 1,
    pad_token_id=VOCAB - 1,
    use_cache=False,
)


def build_model():
    return GPT2LMHeadModel(GPT2Config(**CONFIG))


def _tokens():
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, VOCAB - 1, (BATCH, SEQ + 1), generator=g)


def example_inputs():
    return {"input_ids": _tokens()[:, :-1].contiguous()}


def example_target():
    return _tokens()[:, 1:].contiguous()


def loss_fn(output, target):
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))
