"""Hugging Face GPT-2, a tiny config: a decoder with Conv1D projections and tied embeddings."""
from transformers import GPT2Config, GPT2LMHeadModel
from zoo_hf import VOCAB, lm_loss, tokens


def build_model():
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False))


def example_inputs():
    return {"input_ids": tokens()[:, :-1].contiguous()}


def example_target():
    return tokens()[:, 1:].contiguous()


loss_fn = lm_loss
