"""Hugging Face Bloom, a tiny config: ALiBi attention, a custom autograd GELU, and a forward
that takes `**kwargs`."""
from transformers import BloomConfig, BloomForCausalLM
from zoo_hf import VOCAB, lm_loss, tokens


def build_model():
    return BloomForCausalLM(BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0, attention_dropout=0.0, use_cache=False))


def example_inputs():
    return {"input_ids": tokens()[:, :-1].contiguous()}


def example_target():
    return tokens()[:, 1:].contiguous()


loss_fn = lm_loss
