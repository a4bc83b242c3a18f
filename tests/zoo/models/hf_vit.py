"""Hugging Face ViT, a tiny config: patch embedding, a class token, an image classifier."""
import torch
import torch.nn.functional as F
from transformers import ViTConfig, ViTForImageClassification


def build_model():
    return ViTForImageClassification(ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_labels=5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def example_inputs():
    g = torch.Generator().manual_seed(0)
    return {"pixel_values": torch.randn(4, 3, 16, 16, generator=g)}


def example_target():
    return torch.arange(4) % 5


def loss_fn(output, target):
    return F.cross_entropy(output.logits, target)
