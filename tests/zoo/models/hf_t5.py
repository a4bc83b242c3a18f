"""Hugging Face T5 (encoder-decoder, in-place `relative_buckets += ...`), 2+2 layers."""
from transformers import T5Config, T5ForConditionalGeneration
from zoo_hf import VOCAB, lm_loss, tokens


def build_model():
    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                               num_decoder_layers=2, num_heads=4, dropout_rate=0.0,
                                               relative_attention_num_buckets=8, use_cache=False))


def example_inputs():
    t = tokens()
    return {"input_ids": t[:, :-1].contiguous(), "decoder_input_ids": tokens(99)[:, :-1].contiguous()}


def example_target():
    return tokens(99)[:, 1:].contiguous()


loss_fn = lm_loss
