"""Hugging Face llama with its real vocabulary and 8 layers (benchmarks/models/hf_big_vocab.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hf_big_vocab as _hf  # noqa: E402

KIND = "llama"


def build_model():
    return _hf.build(KIND)


def example_inputs():
    return _hf.inputs(KIND)


def example_target():
    return _hf.target(KIND)


def loss_fn(output, target):
    return _hf.loss(output, target)
