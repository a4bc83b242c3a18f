"""A momentum teacher (MoCo, BYOL): the teacher's copies of the student's weights are
buffers, moved toward the student under `torch.no_grad()` in forward by a loop over the
modules' tensors, and the loss reads both."""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F


class MomentumTeacher(nn.Module):
    def __init__(self, momentum: float = 0.9) -> None:
        super().__init__()
        self.momentum = momentum
        self.student = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
        teacher = copy.deepcopy(self.student)
        for module in teacher.modules():  # the teacher's weights as buffers: state, not trained
            for name, p in list(module._parameters.items()):
                del module._parameters[name]
                module.register_buffer(name, p.detach().clone())
        self.teacher = teacher

    def forward(self, x):
        m = self.momentum
        with torch.no_grad():
            for t, s in zip(self.teacher.buffers(), self.student.parameters()):
                t.mul_(m).add_(s, alpha=1 - m)
        return self.student(x) + 0.5 * self.teacher(x)


def build_model():
    return MomentumTeacher()


def example_inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(8, 4, generator=g),)


def example_target():
    return torch.zeros(8, 2)


def loss_fn(output, target):
    return F.mse_loss(output, target)
