# A VALID model file whose one input is a dict of lists of tensors, with non-tensor leaves
# (an int, None, a bool) beside them; the output is a dict holding a list. Batch 8.
"""A model taking `feats = {"a": [x1, x2], "b": [x3, None], "k": 2, "on": True}`."""

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH, D = 8, 6


class DictOfLists(nn.Module):
    def __init__(self):
        super().__init__()
        self.fa = nn.Linear(D, D)
        self.fb = nn.Linear(D, D)
        self.head = nn.Linear(D, 3)

    def forward(self, feats):
        a1, a2 = feats["a"]
        b, missing = feats["b"]
        h = torch.tanh(self.fa(a1) * feats["k"] + a2)  # (B, D)
        if missing is None and feats["on"]:
            h = h + torch.relu(self.fb(b.transpose(0, 1)))  # b is (D, B): its batch dim is 1
        return {"logits": self.head(h), "extra": [h.sum(-1), b]}


def build_model():
    return DictOfLists()


def example_inputs():
    g = torch.Generator().manual_seed(11)
    a1, a2 = torch.randn(BATCH, D, generator=g), torch.randn(BATCH, D, generator=g)
    b = torch.randn(D, BATCH, generator=g)
    return {"feats": {"a": [a1, a2], "b": [b, None], "k": 2, "on": True}}


BATCH_DIMS = {"feats.b.0": 1}


def example_target():
    return torch.randint(0, 3, (BATCH,), generator=torch.Generator().manual_seed(12))


def loss_fn(output, target):
    return F.cross_entropy(output["logits"], target) + 0.01 * output["extra"][0].mean()
