"""Phi-3 and Phi-4-mini: the plain decoder with no biases, a sliding window on every layer,
partial rotary and longrope scaling (engine/models/rope.py says which factor set a token gets). The
checkpoint stores q/k/v and gate/up fused, rows in the engine's order: they load as they are."""

from __future__ import annotations

import functools
from collections.abc import Callable

from fairbatch.engine.config import ModelConfig, read_hf_config, read_rope
from fairbatch.engine.models import CausalLM, register
from fairbatch.engine.models.rope import rope_long_from

# Phi3Config's defaults where they differ from the common ones
DEFAULTS = dict(
    rms_norm_eps=1e-5, max_position_embeddings=4096, original_max_position_embeddings=4096
)
# Phi3Config knows these two; "su" and "yarn" are its old names of longrope.
ROPE_TYPES, ROPE_ALIASES = ("default", "longrope"), {"su": "longrope", "yarn": "longrope"}


class Phi3ForCausalLM(CausalLM):
    stacked = {}  # the checkpoint holds the engine's fused projections

    @staticmethod
    def cache_salt_rule(config: ModelConfig) -> Callable[[int, str], str] | None:
        """longrope turns every position of a sequence past the original length with its long
        factors: such a sequence's blocks are cached under a salt of their own."""
        long_from = rope_long_from(config)
        return None if long_from is None else functools.partial(_long_salt, long_from)


def _long_salt(long_from: int, num_tokens: int, salt: str) -> str:
    return f"{salt}\x00rope:long" if num_tokens > long_from else salt


@register("Phi3ForCausalLM", "phi3", Phi3ForCausalLM)
def read_config(d: dict, architecture: str) -> ModelConfig:
    d = {**DEFAULTS, **d}
    rope = read_rope(d, architecture, ROPE_TYPES, ROPE_ALIASES, partial=True)
    no_bias = dict(attention_bias=False, o_proj_bias=False, mlp_bias=False)  # whatever it says
    return read_hf_config(d, architecture, rope, **no_bias)
