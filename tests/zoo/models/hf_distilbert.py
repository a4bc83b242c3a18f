"""Hugging Face DistilBERT, a tiny config: an encoder."""
from transformers import DistilBertConfig, DistilBertForMaskedLM
from zoo_hf import VOCAB, lm_loss, tokens


def build_model():
    return DistilBertForMaskedLM(DistilBertConfig(vocab_size=VOCAB, dim=32, hidden_dim=64, n_layers=2, n_heads=4, max_position_embeddings=32, dropout=0.0, attention_dropout=0.0))


def example_inputs():
    return {"input_ids": tokens()[:, :-1].contiguous()}


def example_target():
    return tokens()[:, 1:].contiguous()


loss_fn = lm_loss
