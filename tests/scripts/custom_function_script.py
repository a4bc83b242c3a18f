"""A user's training script, run by tests/test_parallelize.py from a folder of its own: its model
uses a custom autograd Function, and both the model's class and loss_fn live in the script
(`__main__`), so the package keeps a copy of it."""

import copy
import torch
import torch.nn.functional as F
from torch import nn

import partitioner


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class Net(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.c = nn.Linear(width, 4)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = Square.apply(self.b(h))
        return self.c(h)


def loss_fn(output, target):
    return F.cross_entropy(output, target)


def main():
    torch.manual_seed(0)
    model = Net(8)
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    original = copy.deepcopy(model)
    pipe = partitioner.parallelize(model, (x,), loss_fn, out="pkg", stages=2, analytic=True, hardware="a100",
                                   time_limit=5.0, quiet=True)
    opt, ref = torch.optim.SGD(pipe.parameters(), lr=0.1), torch.optim.SGD(original.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad(); ref.zero_grad()
        got = pipe.train_step((x,), y)
        want = loss_fn(original(x), y)
        want.backward()
        opt.step(); ref.step()
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6)
    state = pipe.state_dict()
    for k, v in original.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)
    print("script ok")


if __name__ == "__main__":
    main()
