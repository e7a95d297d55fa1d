"""Random-weight Hugging Face checkpoints with real model shapes, built offline.

Benchmarks measure on these by default: the time of a step depends on the model's shape (hidden
size, layers, heads, intermediate size), not on what its weights learnt. Each shape copies a
published configuration and cuts only the vocabulary, to the 2048 tokens of the tokenizer
fairbatch ships (`engine/assets/`), so the directory is complete (config, weights, tokenizer)
without a download:

* `qwen2.5-0.5b`: Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 query / 2 KV heads,
  intermediate 4864, tied embeddings, q/k/v bias, rope_theta 1e6).
* `llama-3.2-1b`: Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 / 8 heads, head_dim 64,
  intermediate 8192, tied embeddings, llama3 RoPE scaling, rope_theta 500000).
* `tiny`: the 4-layer Llama the tests and the engine benchmark have always used.

Weights come from transformers' own initialisation under a fixed seed (biases, which it
zeroes, drawn like the weights), with initializer_range 0.2 rather than 0.02: peaked next-token
distributions, so greedy tokens rarely hinge on float rounding and two engines' outputs can be
compared token for token. A built directory is cached under `cache_root()` by shape, dtype, seed
and BUILD_VERSION; `ensure_checkpoint` returns it, building it first if needed (a temporary
directory renamed into place, so a half-written one is never used).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from fairbatch.engine.tiny import tiny_config

SEED = 0
BUILD_VERSION = 1  # part of the cache key: raise it when the weights a build writes change
INIT_RANGE = 0.2
VOCAB = 2048  # the shipped tokenizer's ids; ids 0-3 are its special tokens
# The shipped tokenizer's special ids (engine/assets/tiny_generation_config.json).
BOS_ID, EOS_IDS = 0, [1, 3]


def _tiny_shape() -> dict[str, Any]:
    """The embedded tiny model's shape (engine/tiny.py), as an HF Llama config."""
    c = tiny_config(vocab_size=2048)
    keys = (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_theta",
    )
    shape = {k: getattr(c, k) for k in keys}
    return dict(
        architectures=["LlamaForCausalLM"], model_type="llama", **shape, tie_word_embeddings=False
    )


SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        use_sliding_window=False,
        sliding_window=32768,
        max_window_layers=21,
    ),
    "llama-3.2-1b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
    ),
    "tiny": _tiny_shape(),
}
DEFAULT_SHAPE = "qwen2.5-0.5b"  # what benchmarks measure unless told otherwise
DTYPES = ("float32", "bfloat16")


def cache_root() -> Path:
    """$FAIRBATCH_CHECKPOINTS, else ~/.cache/fairbatch/checkpoints."""
    env = os.environ.get("FAIRBATCH_CHECKPOINTS")
    return Path(env) if env else Path.home() / ".cache" / "fairbatch" / "checkpoints"


def hf_config(shape: str | dict[str, Any], **overrides: Any) -> dict[str, Any]:
    """The config.json dict of a named shape (or of a shape dict), with overrides applied."""
    base = SHAPES[shape] if isinstance(shape, str) else shape
    if isinstance(shape, str) and shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    return {
        **base,
        "vocab_size": VOCAB,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_IDS[0],
        "hidden_act": "silu",
        "initializer_range": INIT_RANGE,
        **overrides,
    }


def build_checkpoint(
    path: str | Path, config: dict[str, Any], dtype: str = "float32", seed: int = SEED
) -> Path:
    """Write a checkpoint directory for `config` (an `hf_config` dict) at `path`: config.json,
    model.safetensors, generation_config.json and the shipped tokenizer's files."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from fairbatch.engine.tokenizer import Tokenizer

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    path = Path(path)
    cfg = AutoConfig.for_model(**config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):  # transformers zeroes them: a bias left out would pass
                param.normal_(0.0, INIT_RANGE)
    model = model.to(getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = EOS_IDS
    model.generation_config.bos_token_id = BOS_ID
    model.save_pretrained(path)
    _add_legacy_rope_keys(path / "config.json", config)
    Tokenizer.tiny().save_pretrained(path)
    return path


def _add_legacy_rope_keys(config_file: Path, config: dict[str, Any]) -> None:
    # transformers 5 writes RoPE settings only as `rope_parameters`; a reader on transformers
    # 4.x (the peer engine's own environment may have one) looks for `rope_theta` and
    # `rope_scaling` and would silently fall back on default RoPE. Write both layouts.
    written = json.loads(config_file.read_text())
    written["rope_theta"] = config.get("rope_theta", 10000.0)
    if config.get("rope_scaling"):
        written["rope_scaling"] = dict(config["rope_scaling"])
    config_file.write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")


def ensure_checkpoint(
    shape: str, dtype: str = "float32", seed: int = SEED, root: str | Path | None = None
) -> Path:
    """The cached checkpoint directory of a named shape, built on first use."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    root = Path(root) if root is not None else cache_root()
    final = root / f"{shape}-{dtype}-seed{seed}-v{BUILD_VERSION}"
    if (final / "model.safetensors").is_file() and (final / "tokenizer.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    try:
        build_checkpoint(tmp, hf_config(shape), dtype, seed)
        if final.exists():  # an incomplete leftover of an interrupted build
            shutil.rmtree(final)
        tmp.rename(final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return final


def resolve_model(model: str, dtype: str = "float32") -> Path:
    """A `--model` argument: a named shape (built or cached) or an existing directory."""
    if model in SHAPES:
        return ensure_checkpoint(model, dtype)
    path = Path(model)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"--model {model!r} is neither a known shape ({', '.join(SHAPES)}) nor a "
            "checkpoint directory with a config.json"
        )
    return path


def describe(path: Path) -> dict[str, Any]:
    """A short record of a checkpoint's shape, for results files."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    keys = (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "vocab_size", "tie_word_embeddings",
    )  # fmt: skip
    return {"architecture": (cfg.get("architectures") or ["?"])[0]} | {
        k: cfg[k] for k in keys if k in cfg
    }
