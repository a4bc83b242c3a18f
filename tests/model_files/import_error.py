# BREAKS: imports a module that does not exist, so importing the file raises
# ModuleNotFoundError.
import torch
import this_module_does_not_exist_xyz  # noqa: F401


def build_model():
    return torch.nn.Linear(4, 2)


def example_inputs():
    return (torch.zeros(8, 4),)
