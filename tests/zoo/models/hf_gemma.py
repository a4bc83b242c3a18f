"""Hugging Face Gemma, a tiny config: a decoder with scaled embeddings and GeGLU."""
from transformers import GemmaConfig, GemmaForCausalLM
from zoo_hf import VOCAB, lm_loss, tokens


def build_model():
    return GemmaForCausalLM(GemmaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32, use_cache=False, num_key_value_heads=1, head_dim=8))


def example_inputs():
    return {"input_ids": tokens()[:, :-1].contiguous()}


def example_target():
    return tokens()[:, 1:].contiguous()


loss_fn = lm_loss
