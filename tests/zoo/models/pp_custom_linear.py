"""After PyTorch's pipelining test zoo, re-created: Linears computed by a custom autograd
Function with its own backward (input and weight gradients written out)."""
import torch
import torch.nn as nn
import torch.nn.functional as F

D = 16


class LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return x @ weight.t() + bias

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad @ weight, grad.t() @ x, grad.sum(0)


class CustomLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(LinearFn.apply(x, layer.weight, layer.bias))
        return x


def build_model():
    return CustomLinear()


def example_inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(8, D, generator=g),)


def example_target():
    return torch.ones(8, D)


def loss_fn(output, target):
    return F.mse_loss(output, target)
