"""Hugging Face BART, a tiny config: an encoder-decoder with learned positions."""
from transformers import BartConfig, BartForConditionalGeneration
from zoo_hf import VOCAB, lm_loss, tokens


def build_model():
    return BartForConditionalGeneration(BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, use_cache=False))


def example_inputs():
    return {"input_ids": tokens()[:, :-1].contiguous(), "decoder_input_ids": tokens(99)[:, :-1].contiguous()}


def example_target():
    return tokens(99)[:, 1:].contiguous()


loss_fn = lm_loss
