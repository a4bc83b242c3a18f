"""Everything a package needs of its model file at run time: `loss_fn`, `init_weights` (a
module with no reset_parameters), `batches`, and a submodule kept whole (a data-dependent
`if` neither tracer can trace)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Scale(nn.Module):
    """A per-feature scale with no reset_parameters: `init_weights` initialises it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(width))

    def forward(self, x):
        return x * self.weight


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        h = self.fc(x)
        if torch.isfinite(h).all():
            h = F.relu(h)
        return h + x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 16)
        self.scale = Scale(16)
        self.gate = Gate()
        self.out = nn.Linear(16, 2)

    def forward(self, x):
        return self.out(self.gate(torch.tanh(self.scale(self.inp(x)))))


def build_model():
    model = Net()
    init_weights(model.scale)
    return model


def init_weights(module):
    if isinstance(module, Scale):
        nn.init.uniform_(module.weight, 0.5, 1.5)
    elif callable(getattr(module, "reset_parameters", None)):
        module.reset_parameters()


def example_inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(8, 4, generator=g),)


def example_target():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 2, generator=g)


def batches():
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        yield (torch.randn(8, 4, generator=g),), torch.randn(8, 2, generator=g)


def loss_fn(output, target):
    return F.mse_loss(output, target) * 2.0
