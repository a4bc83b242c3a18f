"""Neural collaborative filtering (NCF / NeuMF-style): LARGE user and item embedding tables
(20,000 users x 64 and 10,000 items x 64: 1.92M parameters, almost no compute), each read by
two branches: a GMF branch (elementwise product of the two embeddings) and an MLP tower on
their concatenation; the two branches are concatenated into one logit.
Inputs are two positional int64 tensors (user_ids, item_ids); the loss is BCE-with-logits on a
float 0/1 target."""

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH = 24
NUM_USERS = 20_000
NUM_ITEMS = 10_000
EMB = 64
TOWER = (128, 256, 128, 64, 32)


class NCF(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.user_emb = nn.Embedding(NUM_USERS, EMB)
        self.item_emb = nn.Embedding(NUM_ITEMS, EMB)
        widths = (2 * EMB,) + TOWER
        self.tower = nn.ModuleList(
            nn.Linear(i, o) for i, o in zip(widths[:-1], widths[1:])
        )
        self.predict = nn.Linear(TOWER[-1] + EMB, 1)

    def forward(self, user_ids: torch.Tensor, item_ids: torch.Tensor) -> torch.Tensor:
        u = self.user_emb(user_ids)
        v = self.item_emb(item_ids)
        gmf = u * v
        h = torch.cat([u, v], dim=-1)
        for layer in self.tower:
            h = F.relu(layer(h))
        return self.predict(torch.cat([h, gmf], dim=-1)).squeeze(-1)  # (B,) logits


def build_model() -> nn.Module:
    return NCF()


def example_inputs():
    g = torch.Generator().manual_seed(1234)
    users = torch.randint(0, NUM_USERS, (BATCH,), generator=g)
    items = torch.randint(0, NUM_ITEMS, (BATCH,), generator=g)
    return (users, items)


def example_target():
    g = torch.Generator().manual_seed(4321)
    return torch.randint(0, 2, (BATCH,), generator=g).float()


def loss_fn(output, target):
    return F.binary_cross_entropy_with_logits(output, target)
