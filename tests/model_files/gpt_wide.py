"""examples/gpt.py at a width where splitting pays on an A100 (d 1024, 16 heads, 128
tokens): the tensor-parallel solver tests and the tp golden package use it."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import gpt  # noqa: E402

CONFIG = gpt.GPTConfig(n_layer=2, n_embd=1024, n_head=16, vocab_size=4096, block_size=128)
gpt.BATCH = 8


def build_model():
    return gpt.build_model(CONFIG)


def example_inputs():
    return gpt.example_inputs(CONFIG)


def example_target():
    return gpt.example_target(CONFIG)


loss_fn = gpt.loss_fn
