"""Hugging Face BERT, a tiny config: an encoder with a masked-LM head."""
from transformers import BertConfig, BertForMaskedLM
from zoo_hf import VOCAB, lm_loss, tokens


def build_model():
    return BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def example_inputs():
    return {"input_ids": tokens()[:, :-1].contiguous()}


def example_target():
    return tokens()[:, 1:].contiguous()


loss_fn = lm_loss
