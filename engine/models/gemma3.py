"""Gemma 3's text model (`Gemma3ForCausalLM`, model_type `gemma3_text`), as transformers
computes it: embeddings scaled by sqrt(hidden_size), `1 + w` norms, sandwich norms, GELU-tanh,
q/k norms, attention scale `query_pre_attn_scalar ** -0.5`, sliding layers with their own window
and RoPE base between global ones, final logits soft-capped. `attn_logit_softcapping` is read
but not applied: transformers' Gemma3 attention never passes it on (a config that sets it warns).
"""

from __future__ import annotations

import torch

from fairbatch.engine.config import FULL, SLIDING, ModelConfig, read_hf_config, read_rope
from fairbatch.engine.models import CausalLM, register
from fairbatch.engine.models.decoder import DecoderLayer, OffsetRMSNorm, RMSNorm

# Gemma3TextConfig's defaults (a published config.json writes all of them).
DEFAULTS = dict(
    rms_norm_eps=1e-6,
    max_position_embeddings=131072,
    head_dim=256,
    tie_word_embeddings=True,
    query_pre_attn_scalar=256,
    sliding_window=4096,
    hidden_activation="gelu_pytorch_tanh",
)


class SandwichLayer(DecoderLayer):
    """Norms around both blocks: the attention output's, and a pair around the MLP."""

    def __init__(self, config: ModelConfig, layer_idx: int, norm: type[RMSNorm]) -> None:
        super().__init__(config, layer_idx, norm)
        self.pre_feedforward_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = norm(config.hidden_size, config.rms_norm_eps)

    def attn_out(self, h: torch.Tensor) -> torch.Tensor:
        return self.post_attention_layernorm(h)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(CausalLM):
    norm_class, layer_class = OffsetRMSNorm, SandwichLayer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # HF multiplies by its float32 buffer cast to the weights' dtype: a python float of
        # that value scales alike (and keeps a captured graph free of host copies)
        x = self.model.embed_tokens(input_ids)
        scale = torch.tensor(self.config.hidden_size**0.5, dtype=torch.float32, device="cpu")
        return x * float(scale.to(x.dtype))


@register("Gemma3ForCausalLM", "gemma3_text", Gemma3ForCausalLM)
def read_config(d: dict, architecture: str) -> ModelConfig:
    d = {**DEFAULTS, **{k: v for k, v in d.items() if v is not None}}
    # Gemma3 reads `hidden_activation` only (a `hidden_act` beside it is ignored, as HF does)
    d["hidden_act"] = d["hidden_activation"]
    if d.get("use_bidirectional_attention"):
        raise NotImplementedError("Gemma3 use_bidirectional_attention is not implemented")
    types = d.get("layer_types")
    if types is None:  # the older config.json: every `sliding_window_pattern`-th layer global
        pattern = int(d.get("sliding_window_pattern", 6))
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(int(d["num_hidden_layers"]))]
    params = d.get("rope_parameters")
    if isinstance(params, dict) and (SLIDING in params or FULL in params):
        # transformers 5: one rope dict per layer type, theta inside
        local = dict(params.get(SLIDING) or {})
        global_rope = {**d, "rope_parameters": dict(params.get(FULL) or {}), "rope_scaling": None}
    else:  # transformers 4: rope_theta + rope_scaling (global), rope_local_base_freq (local)
        local, global_rope = {}, {**d, "rope_parameters": None}
    # A theta missing from the rope dicts comes from the top-level keys, else HF's defaults.
    local.setdefault("rope_theta", d.get("rope_local_base_freq", 10000.0))
    global_rope.setdefault("rope_theta", 1_000_000.0)
    local_type = local.get("rope_type") or local.get("type") or "default"
    if local_type != "default":
        raise NotImplementedError(
            f"Gemma3 sliding-layer rope_type={local_type!r} is not implemented (only default)"
        )
    caps = {k: d.get(k) for k in ("final_logit_softcapping", "attn_logit_softcapping")}
    return read_hf_config(
        d,
        architecture,
        read_rope(global_rope, architecture),
        mlp_bias=False,
        hidden_act="gelu_pytorch_tanh",
        qk_norm=True,
        layer_types=tuple(types),
        rope_local_theta=float(local["rope_theta"]),
        query_pre_attn_scalar=float(d["query_pre_attn_scalar"]),
        **{k: None if v is None else float(v) for k, v in caps.items()},
    )
