"""GPT-3 175B (Brown et al. 2020, table 2.1: 96 layers, d_model 12288, 96 heads, context
2048) as the decoder of gpt.py, in bfloat16, for planning with `--analytic` only.

    python -m partitioner compile examples/gpt3_175b.py --out build/gpt3 --analytic \\
        --devices 1024 --hardware h100 --memory 80GiB

The weights take 350 GB, so `--analytic` builds the model on the meta device (shapes and
dtypes, no storage) and nothing is executed; calling `build_model()` outside the meta
device would try to allocate all of it.  The example batch is Megatron-LM's published
configuration for this model (examples/gpt3/train_gpt3_175b_distributed.sh: global batch
1536 sequences of 2048 tokens).

The vocabulary is GPT-2's 50257 tokens padded to 51200, the next multiple of 128 x 8, as
Megatron-LM does (Shoeybi et al. 2019, section 5.1): each of 8 tensor-parallel ranks then
holds a vocabulary slice of 6400 rows, a multiple of 128 for efficient logit GEMMs, and the
vocabulary-split embedding rule applies (it needs the rows to divide by the tp degree).
The embedding and the LM head share one weight, as in Megatron-LM's GPT.
"""

import importlib.util
import os

import torch

_spec = importlib.util.spec_from_file_location(
    "_examples_gpt3_gpt", os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt.py")
)
_gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_gpt)

GPT2_VOCAB = 50257
PAD_MULTIPLE = 128 * 8  # Megatron-LM: 128 rows per tensor-parallel rank, up to 8 ranks
VOCAB = -(-GPT2_VOCAB // PAD_MULTIPLE) * PAD_MULTIPLE  # 51200

CONFIG = _gpt.GPTConfig(n_layer=96, n_embd=12288, n_head=96, vocab_size=VOCAB, block_size=2048)
_gpt.BATCH = 1536  # Megatron-LM's global batch for GPT-3 175B
DTYPE = torch.bfloat16

loss_fn = _gpt.loss_fn


def build_model():
    return _gpt.build_model(CONFIG).to(DTYPE)


def example_inputs():
    return _gpt.example_inputs(CONFIG)


def example_target():
    return _gpt.example_target(CONFIG)
