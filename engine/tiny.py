"""The embedded default model: a small decoder with fixed random weights and the shipped tokenizer.

No download and no `transformers`: the weights come from a seeded generator, so every run (and
every replica) builds the same model. Its text is gibberish; its tokens are exact and
reproducible, which is what serving tests need.
"""

from __future__ import annotations

import torch

from fairbatch.engine.config import ModelConfig
from fairbatch.engine.models import CausalLM
from fairbatch.engine.tokenizer import Tokenizer

TINY_SEED = 1234
TINY_INIT_STD = 0.15


def tiny_config(vocab_size: int, eos_token_ids: tuple[int, ...] = ()) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        eos_token_ids=eos_token_ids,
    )


def build_tiny(
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    attn_backend: str | None = None,
) -> tuple[CausalLM, ModelConfig, Tokenizer]:
    tokenizer = Tokenizer.tiny()
    config = tiny_config(tokenizer.vocab_size, tuple(tokenizer.eos_token_ids))
    device = torch.device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model = CausalLM(config, attn_backend=attn_backend)
    gen = torch.Generator().manual_seed(TINY_SEED)
    with torch.no_grad():
        # Fill in name order from one seeded CPU generator: identical on every machine/device.
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                # Larger than training-style init (0.02) on purpose: peaked next-token
                # distributions, so greedy decoding never hinges on float rounding (a
                # near-uniform model would make bf16-vs-fp32 or batch-shape ties common).
                param.copy_(torch.randn(param.shape, generator=gen) * TINY_INIT_STD)
    return model.to(device=device, dtype=dtype).eval(), config, tokenizer
