"""Hugging Face GPT-2, Llama and BERT with a real vocabulary (50257, 32000, 30522 tokens) and
8 layers, at a width this 2-core machine trains in milliseconds: the large-vocabulary shape
where an even split of layers leaves the embedding and the LM head (its logits and the loss
over them) unbalanced.  `KIND` (gpt2 | llama | bert) picks the model; the model files
hf_gpt2_big.py, hf_llama_big.py and hf_bert_big.py set it."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

BATCH, SEQ, LAYERS, WIDTH = 8, 32, 8, 64
VOCAB = {"gpt2": 50257, "llama": 32000, "bert": 30522}


def build(kind: str) -> torch.nn.Module:
    from transformers import (BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                              LlamaForCausalLM)

    if kind == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB[kind], n_positions=SEQ, n_embd=WIDTH, n_layer=LAYERS,
                                          n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                          tie_word_embeddings=False))
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB[kind], hidden_size=WIDTH, intermediate_size=4 * WIDTH,
                                            num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=SEQ, use_cache=False, tie_word_embeddings=False))
    return BertForMaskedLM(BertConfig(vocab_size=VOCAB[kind], hidden_size=WIDTH, intermediate_size=4 * WIDTH,
                                      num_hidden_layers=LAYERS, num_attention_heads=4, max_position_embeddings=SEQ,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                      tie_word_embeddings=False))


def tokens(kind: str) -> torch.Tensor:
    return torch.randint(0, VOCAB[kind], (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))


def inputs(kind: str) -> dict[str, Any]:
    return {"input_ids": tokens(kind)[:, :-1].contiguous()}


def target(kind: str) -> torch.Tensor:
    return tokens(kind)[:, 1:].contiguous()


def loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))
