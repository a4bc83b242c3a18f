"""The nanoGPT-like decoder of gpt.py, deeper and wider: 48 blocks, n_embd 64, 4 heads,
vocab 64, sequence 8. For benchmarks that want many layers. It loads gpt.py from this file's
own directory (model files are imported by path, so a plain `import gpt` would not work)."""

import importlib.util
import os

_spec = importlib.util.spec_from_file_location(
    "_examples_gpt", os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt.py")
)
_gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_gpt)

CONFIG = _gpt.GPTConfig(n_layer=48, n_embd=64, n_head=4, vocab_size=64, block_size=8)
loss_fn = _gpt.loss_fn


def build_model():
    return _gpt.build_model(CONFIG)


def example_inputs():
    return _gpt.example_inputs(CONFIG)


def example_target():
    return _gpt.example_target(CONFIG)
