"""A user's training script, run by tests/test_output_classes.py from a folder of its own: its
model returns a dataclass the script defines (`__main__`), and `pipe(x)` returns that class,
the script's own, as the model does."""

import copy
import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

import partitioner


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    hidden: torch.Tensor


class Net(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.c = nn.Linear(width, 4)

    def forward(self, x):
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        return Out(self.c(h), h)


def loss_fn(output, target):
    assert isinstance(output, Out), f"loss_fn got {type(output)}"
    return F.cross_entropy(output.logits, target) + 0.1 * output.hidden.pow(2).mean()


def main():
    torch.manual_seed(0)
    model = Net(8)
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    original = copy.deepcopy(model)
    pipe = partitioner.parallelize(model, (x,), loss_fn, out="pkg", stages=2, microbatches=4, analytic=True,
                                   hardware="a100", time_limit=5.0, quiet=True)
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
    with torch.no_grad():
        out, want = pipe((x,)), original(x)
    assert type(out) is Out, f"pipe(x) returned {type(out)}, not the script's {Out}"
    torch.testing.assert_close(dataclasses.asdict(out), dataclasses.asdict(want), rtol=1e-5, atol=1e-6)
    print("script ok")


if __name__ == "__main__":
    main()
