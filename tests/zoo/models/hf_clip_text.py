"""Hugging Face CLIP text model (a causal mask built from constants only), 2 layers."""
import torch
from transformers import CLIPTextConfig, CLIPTextModel
from zoo_hf import BATCH, SEQ, VOCAB, hidden_loss, tokens


def build_model():
    return CLIPTextModel(CLIPTextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=SEQ, attention_dropout=0.0))


def example_inputs():
    return {"input_ids": tokens()[:, :-1].contiguous()}


def example_target():
    return torch.zeros(BATCH, SEQ, 32)


loss_fn = hidden_loss
