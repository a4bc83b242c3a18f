"""Hugging Face GPT-2 from a tiny GPT2Config with its default dropouts (attention 0.1, in
SDPA's `dropout_p`, and residual / embedding 0.1), for the eval-mode tests
(tests/runtime/test_eval_modes.py): the trace sees `dropout_p=0.1` in train mode."""

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

BATCH, SEQ, VOCAB = 8, 8, 96


def build_model():
    config = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4, use_cache=False,
                        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, pad_token_id=VOCAB - 1,
                        attn_implementation="sdpa")
    assert config.attn_pdrop == 0.1 and config.resid_pdrop == 0.1
    return GPT2LMHeadModel(config)


def _tokens():
    return torch.randint(0, VOCAB - 1, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1234))


def example_inputs():
    return {"input_ids": _tokens()[:, :-1].contiguous()}


def example_target():
    return _tokens()[:, 1:].contiguous()


def loss_fn(output, target):
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))
