"""hf_llama_dynamic_rope.py with `max_position_embeddings` 32, past the batch's 8 positions: the
rotary embedding (kept whole all the same) never rescales."""
import hf_llama_dynamic_rope
from hf_llama_dynamic_rope import example_inputs, example_target, loss_fn  # noqa: F401


def build_model():
    return hf_llama_dynamic_rope.build_model(max_positions=32)
