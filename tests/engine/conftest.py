"""Tiny reference checkpoints, built offline with transformers once per test session.

Each fixture returns the path of a Hugging Face model directory (config.json, safetensors,
generation_config.json) holding a randomly initialised float32 model:

* `llama_ckpt`: Llama, GQA (4 heads, 2 KV heads), default RoPE; `generation_config.json` has
  `eos_token_id: [2, 5]` (a list, as Llama 3.1 ships it).
* `llama3_ckpt`: Llama with `rope_scaling` of type llama3 (short original context, so all
  three frequency bands of the scaling occur), saved SHARDED (`model.safetensors.index.json`).
* `qwen2_ckpt`: Qwen2 with q/k/v bias and `tie_word_embeddings=True`.
* `mistral_ckpt`: Mistral with `sliding_window=16`, so prompts past 16 tokens exercise it.

The weights use initializer_range 0.2 rather than HF's 0.02: the logits come out peaked enough
that greedy argmax never hinges on float rounding, which keeps token-for-token comparisons
stable across machines.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

VOCAB = 512
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
)


def _build(
    root: Path,
    name: str,
    model_cls: type,
    config_cls: type,
    seed: int,
    shard: bool = False,
    **overrides: object,
) -> Path:
    torch.manual_seed(seed)
    config = config_cls(**{**COMMON, **overrides})
    config._attn_implementation = "eager"
    model = model_cls(config).to(torch.float32).eval()
    path = root / name
    # A small max_shard_size splits the model over several files plus an index.
    model.save_pretrained(path, max_shard_size="100KB" if shard else "10GB")
    return path


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ckpts")


@pytest.fixture(scope="session")
def llama_ckpt(ckpt_root: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    path = _build(ckpt_root, "llama", LlamaForCausalLM, LlamaConfig, seed=0)
    gen_file = path / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.exists() else {}
    gen["eos_token_id"] = [2, 5]
    gen_file.write_text(json.dumps(gen, indent=2))
    return path


@pytest.fixture(scope="session")
def llama3_ckpt(ckpt_root: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    return _build(
        ckpt_root, "llama3", LlamaForCausalLM, LlamaConfig, seed=1, shard=True, rope_scaling=rope
    )


@pytest.fixture(scope="session")
def qwen2_ckpt(ckpt_root: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _build(
        ckpt_root,
        "qwen2",
        Qwen2ForCausalLM,
        Qwen2Config,
        seed=2,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
    )


@pytest.fixture(scope="session")
def mistral_ckpt(ckpt_root: Path) -> Path:
    from transformers import MistralConfig, MistralForCausalLM

    return _build(
        ckpt_root,
        "mistral",
        MistralForCausalLM,
        MistralConfig,
        seed=3,
        head_dim=16,
        sliding_window=16,
    )
