"""What the Hugging Face zoo files share: a fixed token batch and a next-token loss."""
import torch
import torch.nn.functional as F

BATCH, SEQ, VOCAB = 4, 8, 64


def tokens(seed: int = 1234, vocab: int = VOCAB) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab - 1, (BATCH, SEQ + 1), generator=g)


def lm_loss(output, target):
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def hidden_loss(output, target):
    return F.mse_loss(output.last_hidden_state, target)
