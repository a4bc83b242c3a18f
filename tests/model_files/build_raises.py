# BREAKS: build_model() raises ValueError("boom").
import torch
import torch.nn.functional as F


def build_model():
    raise ValueError("boom")


def example_inputs():
    return (torch.zeros(8, 4),)


def example_target():
    return torch.zeros(8, 2)


def loss_fn(output, target):
    return F.mse_loss(output, target)
