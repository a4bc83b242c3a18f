# BREAKS: a real syntax error (unclosed parenthesis on the `def build_model(` line), so the
# file cannot even be compiled.
import torch


def build_model(
    return torch.nn.Linear(4, 2)


def example_inputs():
    return (torch.zeros(2, 4),)
