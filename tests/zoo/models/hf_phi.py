"""Hugging Face Phi, a tiny config: a decoder with partial rotary and a biased LM head."""
from transformers import PhiConfig, PhiForCausalLM
from zoo_hf import VOCAB, lm_loss, tokens


def build_model():
    return PhiForCausalLM(PhiConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0))


def example_inputs():
    return {"input_ids": tokens()[:, :-1].contiguous()}


def example_target():
    return tokens()[:, 1:].contiguous()


loss_fn = lm_loss
