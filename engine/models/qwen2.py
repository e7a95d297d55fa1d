"""Qwen2 (and Qwen2.5): the plain decoder with a bias on q, k and v, never on o or the MLP."""

from __future__ import annotations

from fairbatch.engine.config import ModelConfig, read_hf_config, switched_window
from fairbatch.engine.models import register


@register("Qwen2ForCausalLM", "qwen2")
def read_config(d: dict, architecture: str) -> ModelConfig:
    bias = dict(attention_bias=True, o_proj_bias=False, mlp_bias=False)
    return read_hf_config(d, architecture, sliding_window=switched_window(d, architecture), **bias)
