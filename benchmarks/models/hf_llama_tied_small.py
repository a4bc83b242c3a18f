"""Hugging Face Llama with its head tied to the embedding at a small config (benchmarks/models/hf_small.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_small import contract  # noqa: E402

build_model, example_inputs, example_target, loss_fn = contract("llama_tied")
