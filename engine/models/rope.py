"""Rotary position embeddings (RoPE), computed as transformers computes them.

cos/sin come from float32 positions times float32 inverse frequencies, are multiplied by the
rope type's attention factor (1 but for longrope) and cast to the activation dtype; q and k turn
in the rotate-half (GPT-NeoX) convention. With `partial_rotary_factor` < 1 (e.g. 0.75) only
the first `rotary_dim` of each head turns, the rest passes through.

longrope has two sets of per-frequency factors. transformers picks one per forward call
(`max(position_ids) + 1 > original` selects long_factor for the whole call), and the
`generate` of its longrope models adds a rule: when a sequence first grows past the original
length it drops its cache and recomputes every position with long_factor. So a sequence turns
all its positions with the factors its length says: short while it has at most
`original_max_position_embeddings` tokens, long once it has more. The engine does the same per
request: a request longer than that when it arrives is long from its first token, one that
grows past it is recomputed long at that point (a recompute preemption, EngineCore._resalt),
and the prefix-cache salt (the family's `cache_salt_rule`) says which set turned a block.
Here, positions from `long_from` on always turn long (a decode token there belongs to a long
sequence), and the runner flags the other tokens of long sequences for a step (`long_tokens`;
only a long prefill below the original length needs them, so a replayed decode CUDA graph
needs none).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from fairbatch.engine.config import ModelConfig


def _exponents(dim: int) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """`[rotary_dim // 2]` float32 inverse frequencies, computed as transformers computes them
    (for longrope: the short-factor set)."""
    dim = config.rotary_dim
    exponents = _exponents(dim)
    scaling = config.rope_scaling
    if scaling is not None and scaling["rope_type"] == "longrope":
        return _longrope_inv_freq(config, scaling["short_factor"])
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_long_inv_freq(config: ModelConfig) -> torch.Tensor | None:
    """longrope's long-factor inverse frequencies `[rotary_dim // 2]`; None for other types."""
    scaling = config.rope_scaling
    if scaling is None or scaling["rope_type"] != "longrope":
        return None
    return _longrope_inv_freq(config, scaling["long_factor"])


def _longrope_inv_freq(config: ModelConfig, factors: tuple[float, ...]) -> torch.Tensor:
    # transformers' _compute_longrope_parameters, operation for operation
    ext_factors = torch.tensor(factors, dtype=torch.float32, device="cpu")
    return 1.0 / (ext_factors * config.rope_theta ** _exponents(config.rotary_dim))


def rope_long_from(config: ModelConfig) -> int | None:
    """The sequence length past which longrope turns every position with its long factors
    (`original_max_position_embeddings`); None when the model has no longrope."""
    scaling = config.rope_scaling
    if scaling is None or scaling["rope_type"] != "longrope":
        return None
    return int(scaling.get("original_max_position_embeddings", 0))


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # Plain attributes, not buffers: the loader builds the model on the meta device, and
        # these must survive that; they move to the activations' device on first use.
        self.inv_freq = rope_inv_freq(config)  # [rotary_dim // 2]
        self.long_inv_freq = rope_long_inv_freq(config)  # longrope only
        scaling = config.rope_scaling or {}
        self.attention_scaling = float(scaling.get("attention_factor", 1.0))
        # Positions from here on turn with long_inv_freq, and so do the tokens the runner flags
        # for a step (`long_tokens [T]` bool, or None): see the module docstring.
        self.long_from = rope_long_from(config)  # None without longrope
        self.long_tokens: torch.Tensor | None = None
        self.reads_schedule = self.long_from is not None  # the runner calls set_step

    def set_step(self, out: Any, device: Any) -> None:
        """longrope: flag the tokens of the step's sequences past the original length (the
        engine recomputes one that grows past it: EngineCore._resalt); positions past that
        length turn long anyway. Only a long request's prefill below it needs the flags; other
        steps (every decode step, so a replayed CUDA graph) build none. `out`: the step's
        SchedulerOutput."""
        long_from = self.long_from
        self.long_tokens = None
        if not any(
            long_from < r.num_tokens and r.num_computed_tokens < long_from for r in out.scheduled
        ):
            return
        flags: list[bool] = []
        for req in out.scheduled:
            flags += [req.num_tokens > long_from] * out.num_scheduled_tokens[req.request_id]
        self.long_tokens = torch.tensor(flags, dtype=torch.bool).to(device)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[T, 1, rotary_dim]` for positions `[T]`; computed once per step."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        inv_freq = self.inv_freq[None, :]  # [1, D/2]
        if self.long_inv_freq is not None:
            if self.long_inv_freq.device != positions.device:
                self.long_inv_freq = self.long_inv_freq.to(positions.device)
            # Per token, on the device (no sync; a CUDA graph replays it).
            long = positions >= self.long_from
            if self.long_tokens is not None:  # tokens of long sequences, whatever their position
                long = long | self.long_tokens
            inv_freq = torch.where(long[:, None], self.long_inv_freq[None, :], inv_freq)
        freqs = positions[:, None].float() * inv_freq  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:  # transformers multiplies always; by 1 it is exact
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[T, heads, head_dim]`; rotate-half convention (HF / GPT-NeoX), not interleaved
    pairs. cos/sin may cover fewer dims than a head (partial rotary): the rest passes."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
        return torch.cat((apply_rope(x_rot, cos, sin), x_pass), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
