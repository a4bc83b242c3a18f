# A VALID model file: the word-language LSTM of PyTorch's examples (embedding, a 2-layer
# nn.LSTM with a hidden state tuple, a linear decoder), small sizes. forward(x, (h0, c0))
# returns (output, (h, c)); the hidden state's batch dimension is 1, as BATCH_DIMS says.
"""The word-language LSTM: nested inputs and outputs."""

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, EMBED, HIDDEN, LAYERS, SEQ, BATCH = 20, 8, 12, 3, 5, 8

BATCH_DIMS = {"hidden": 1}


class WordLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Embedding(VOCAB, EMBED)
        self.rnn = nn.LSTM(EMBED, HIDDEN, LAYERS, batch_first=True)
        self.decoder = nn.Linear(HIDDEN, VOCAB)

    def forward(self, x, hidden):
        emb = self.encoder(x)  # (B, T, E)
        output, hidden = self.rnn(emb, hidden)  # (B, T, H); ((L, B, H), (L, B, H))
        return self.decoder(output), hidden


def build_model():
    return WordLSTM()


def example_inputs():
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    h0 = torch.randn(LAYERS, BATCH, HIDDEN, generator=g)
    c0 = torch.randn(LAYERS, BATCH, HIDDEN, generator=g)
    return (x, (h0, c0))


def example_target():
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(6))


def loss_fn(output, target):
    logits, (h, c) = output
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1)) + 0.1 * h.pow(2).mean() + 0.1 * c.mean()
