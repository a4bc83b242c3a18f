"""An LSTM language model (nn.LSTM, two layers) with a GRU on top: recurrent ops as single nodes."""
import torch
import torch.nn as nn
import torch.nn.functional as F

V, D = 32, 16


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.lstm = nn.LSTM(D, D, num_layers=2, batch_first=True)
        self.gru = nn.GRU(D, D, batch_first=True)
        self.head = nn.Linear(D, V)

    def forward(self, tokens):
        x, _ = self.lstm(self.embed(tokens))
        x, _ = self.gru(x)
        return self.head(x)


def build_model():
    return Recurrent()


def _tokens():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, V, (4, 7), generator=g)


def example_inputs():
    return (_tokens()[:, :-1].contiguous(),)


def example_target():
    return _tokens()[:, 1:].contiguous()


def loss_fn(output, target):
    return F.cross_entropy(output.reshape(-1, V), target.reshape(-1))
