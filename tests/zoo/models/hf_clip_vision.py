"""Hugging Face CLIP vision model, a tiny config: pre-LayerNorm, a class embedding."""
import torch
from transformers import CLIPVisionConfig, CLIPVisionModel
from zoo_hf import hidden_loss


def build_model():
    return CLIPVisionModel(CLIPVisionConfig(
        image_size=16, patch_size=4, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, attention_dropout=0.0))


def example_inputs():
    g = torch.Generator().manual_seed(0)
    return {"pixel_values": torch.randn(4, 3, 16, 16, generator=g)}


def example_target():
    return torch.zeros(4, 17, 32)


loss_fn = hidden_loss
