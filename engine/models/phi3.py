"""Phi-3 and Phi-4-mini: the plain decoder with no biases, a sliding window on every layer,
partial rotary and longrope scaling (engine/rope.py says which factor set a token gets). The
checkpoint stores q/k/v and gate/up fused, rows in the engine's order: they load as they are."""

from __future__ import annotations

from fairbatch.engine.config import ModelConfig, read_hf_config, read_rope
from fairbatch.engine.models import CausalLM, register

# Phi3Config's defaults where they differ from the common ones
DEFAULTS = dict(
    rms_norm_eps=1e-5, max_position_embeddings=4096, original_max_position_embeddings=4096
)
# Phi3Config knows these two; "su" and "yarn" are its old names of longrope.
ROPE_TYPES, ROPE_ALIASES = ("default", "longrope"), {"su": "longrope", "yarn": "longrope"}


class Phi3ForCausalLM(CausalLM):
    stacked = {}  # the checkpoint holds the engine's fused projections


@register("Phi3ForCausalLM", "phi3", Phi3ForCausalLM)
def read_config(d: dict, architecture: str) -> ModelConfig:
    d = {**DEFAULTS, **d}
    rope = read_rope(d, architecture, ROPE_TYPES, ROPE_ALIASES, partial=True)
    no_bias = dict(attention_bias=False, o_proj_bias=False, mlp_bias=False)  # whatever it says
    return read_hf_config(d, architecture, rope, **no_bias)
