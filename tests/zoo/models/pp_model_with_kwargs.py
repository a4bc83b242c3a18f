"""After PyTorch's pipelining test zoo, re-created: a second input passed by keyword, with a
tensor default the example batch leaves unset."""
import torch
import torch.nn as nn
import torch.nn.functional as F

D = 16


class ModelWithKwargs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mm_param0 = nn.Parameter(torch.randn(D, D) / 4)
        self.lin0 = nn.Linear(D, D)
        self.lin1 = nn.Linear(D, D)

    def forward(self, x, y=torch.zeros(8, D), scale=torch.tensor(0.5)):
        x = torch.mm(x, self.mm_param0) + y
        x = torch.relu(self.lin0(x)) * scale
        return self.lin1(x + y)


def build_model():
    return ModelWithKwargs()


def example_inputs():
    g = torch.Generator().manual_seed(0)
    return {"x": torch.randn(8, D, generator=g), "y": torch.randn(8, D, generator=g)}


def example_target():
    return torch.zeros(8, D)


def loss_fn(output, target):
    return F.mse_loss(output, target)
