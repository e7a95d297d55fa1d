"""Qwen3 and Qwen3-MoE: the plain decoder with per-head q/k norms before RoPE (transformers'
Qwen3Attention); `attention_bias` biases q, k, v and o alike. In Qwen3-MoE the layers that
`is_moe_layer` picks have a sparse mixture of experts (`decoder.SparseMoeBlock`)."""

from __future__ import annotations

from fairbatch.engine.config import ModelConfig, read_hf_config, switched_window
from fairbatch.engine.models import register


@register("Qwen3ForCausalLM", "qwen3")
def read_config(d: dict, architecture: str, **experts) -> ModelConfig:
    # Qwen3Config defaults head_dim to 128 rather than deriving it (its checkpoints always
    # write it; a dict built in code may not).
    fields = dict(head_dim=int(d.get("head_dim") or 128), mlp_bias=False, qk_norm=True)
    window = switched_window(d, architecture)
    return read_hf_config(d, architecture, sliding_window=window, **fields, **experts)


@register("Qwen3MoeForCausalLM", "qwen3_moe")
def read_moe_config(d: dict, architecture: str) -> ModelConfig:
    # transformers 5 saves `num_experts` under its attribute_map name `num_local_experts`;
    # the published checkpoints write `num_experts`. Defaults are HF's.
    num_experts = int(d.get("num_experts", d.get("num_local_experts", 128)))
    return read_config(
        d,
        architecture,
        num_experts=num_experts,
        num_experts_per_tok=int(d.get("num_experts_per_tok", 8)) if num_experts else 0,
        moe_intermediate_size=int(d.get("moe_intermediate_size", 768)),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()),
        decoder_sparse_step=int(d.get("decoder_sparse_step", 1)),
    )
