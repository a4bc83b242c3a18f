"""Hugging Face `transformers.BertForSequenceClassification` from a tiny BertConfig
(4 layers, hidden 32, 4 heads, intermediate 64, vocab 96, 16 positions, 3 labels, all dropout
0), returned unchanged. Inputs are keyword arguments {"input_ids", "attention_mask"}; the
last rows are padded (attention_mask 0 on their tail). The loss is cross-entropy on
`output.logits` (a SequenceClassifierOutput)."""

import torch
import torch.nn.functional as F
from transformers import BertConfig, BertForSequenceClassification

BATCH = 24
SEQ = 8
VOCAB = 96
NUM_LABELS = 3

CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=16,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    classifier_dropout=0.0,
    num_labels=NUM_LABELS,
    pad_token_id=0,
    use_cache=False,
)


def build_model():
    return BertForSequenceClassification(BertConfig(**CONFIG))


def example_inputs():
    g = torch.Generator().manual_seed(1234)
    input_ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    # sequence lengths SEQ, SEQ-1, ..., cycling: some rows padded at the tail
    lengths = SEQ - (torch.arange(BATCH) % 4)
    attention_mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    input_ids = input_ids * attention_mask  # pad id 0 where masked
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def example_target():
    g = torch.Generator().manual_seed(4321)
    return torch.randint(0, NUM_LABELS, (BATCH,), generator=g)


def loss_fn(output, target):
    return F.cross_entropy(output.logits, target)
