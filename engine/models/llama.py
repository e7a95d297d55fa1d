"""Llama (2, 3.x): the plain pre-norm decoder; llama3 RoPE scaling included."""

from __future__ import annotations

from fairbatch.engine.config import ModelConfig, read_hf_config
from fairbatch.engine.models import register


@register("LlamaForCausalLM", "llama")
def read_config(d: dict, architecture: str) -> ModelConfig:
    return read_hf_config(d, architecture, sliding_window=None)  # no windowed attention
