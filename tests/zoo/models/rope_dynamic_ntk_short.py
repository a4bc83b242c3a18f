"""rope_dynamic_ntk.py with `max_position_embeddings` 32, past the batch's 8 positions: the rotary
(kept whole all the same) never rescales."""
from rope_dynamic_ntk import Decoder, example_inputs, example_target, loss_fn  # noqa: F401


def build_model():
    return Decoder(max_pos=32)
