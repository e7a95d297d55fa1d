"""Mistral: the plain decoder with a sliding window on every layer and never a bias."""

from __future__ import annotations

from fairbatch.engine.config import ModelConfig, read_hf_config
from fairbatch.engine.models import register


@register("MistralForCausalLM", "mistral")
def read_config(d: dict, architecture: str) -> ModelConfig:
    return read_hf_config(d, architecture, attention_bias=False, o_proj_bias=False, mlp_bias=False)
