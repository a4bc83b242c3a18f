"""Hugging Face Gemma 2, a small config whose activations outweigh its parameters: eager
attention with its logits soft-capped, a soft-capped head, sliding-window layers and
sandwich norms."""
import torch.nn.functional as F
from transformers import Gemma2Config, Gemma2ForCausalLM
from zoo_hf import tokens

BATCH, SEQ, VOCAB = 8, 32, 64


def build_model():
    return Gemma2ForCausalLM(Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                          max_position_embeddings=SEQ, sliding_window=8, query_pre_attn_scalar=16,
                                          use_cache=False, attn_implementation="eager"))


def _batch():
    return tokens().repeat(BATCH, 4)[:BATCH, :SEQ + 1]


def example_inputs():
    return {"input_ids": _batch()[:, :-1].contiguous()}


def example_target():
    return _batch()[:, 1:].contiguous()


def loss_fn(output, target):
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
