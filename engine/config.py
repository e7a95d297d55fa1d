"""The shape of a decoder model, read from a Hugging Face `config.json`.

`ModelConfig` holds capabilities, not families: q/k norms, mixture-of-experts layers, partial
rotary and RoPE scaling (llama3, linear, longrope: engine/models/rope.py), sliding windows,
interleaved sliding and global layers, the attention scale, the activation, the logit
soft-cap. A pure dataclass: building one never touches the disk, so the scheduler, the
simulated runner and tests can describe a model without a checkpoint. `from_hf_dict` hands a
`config.json` to the family its `architecture` names (engine/models), which reads it with the
helpers below; both the transformers 4.x layout (`rope_theta` + `rope_scaling`) and the 5.x
one (`rope_parameters`).

Sliding windows: `sliding_window` on every layer, or with `layer_types` on the SLIDING layers
only. A window `w` means query position `p` sees keys `p - w + 1 .. p`, as Hugging Face masks
it; one at least as long as `max_position_embeddings` can never bind, so it is dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# rope_type values whose inv_freq we compute as transformers does (a family may add longrope)
ROPE_TYPES = ("default", "llama3", "linear")
SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None for plain RoPE; else {"rope_type": "llama3" | "linear" | "longrope", ...HF keys}
    # (longrope's normalised: short/long factors, original length, attention factor).
    rope_scaling: dict[str, Any] | None = None
    partial_rotary_factor: float = 1.0  # RoPE turns the first `rotary_dim` of each head only
    max_position_embeddings: int = 2048
    attention_bias: bool = False  # bias on q/k/v projections
    o_proj_bias: bool = False  # bias on the output projection
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # None: full causal attention
    # Per layer, SLIDING or FULL: only SLIDING layers use `sliding_window` and turn with
    # `rope_local_theta`. Empty: every layer uses `sliding_window`.
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE
    # Mixture of experts; num_experts 0 means every layer has a dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    mlp_only_layers: tuple[int, ...] = ()  # layers that keep a dense MLP
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0
    hidden_act: str = "silu"  # "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU)
    query_pre_attn_scalar: float | None = None  # attention scale scalar**-0.5, not head_dim's
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    attn_logit_softcapping: float | None = None  # read, never applied, as in transformers
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # The HF architecture name (engine/models' registry key); None: the plain decoder that
    # these fields describe, as a config built in code has it.
    architecture: str | None = None
    dtype: str | None = None  # the checkpoint's dtype name ("bfloat16", ...), informational

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(
                f"rotary_dim (head_dim {self.head_dim} * partial_rotary_factor "
                f"{self.partial_rotary_factor}) must be even and in 2..head_dim"
            )
        if self.rope_scaling is not None and self.rope_scaling["rope_type"] == "longrope":
            for key in ("short_factor", "long_factor"):
                if len(self.rope_scaling[key]) != self.rotary_dim // 2:
                    raise ValueError(
                        f"longrope {key} has {len(self.rope_scaling[key])} entries; "
                        f"rotary_dim // 2 = {self.rotary_dim // 2} expected"
                    )
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                f"1..num_experts ({self.num_experts})"
            )
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
        if self.layer_types:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(
                    f"layer_types has {len(self.layer_types)} entries for "
                    f"{self.num_hidden_layers} layers"
                )
            unknown = set(self.layer_types) - {SLIDING, FULL}
            if unknown:
                raise NotImplementedError(f"layer types {sorted(unknown)} are not implemented")
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise NotImplementedError(
                f"hidden_act={self.hidden_act!r}: only silu and gelu_pytorch_tanh are implemented"
            )

    def is_sliding_layer(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` is a sliding layer of an interleaved model: its window is
        `sliding_window` and it turns with `rope_local_theta`."""
        return bool(self.layer_types) and self.layer_types[layer_idx] == SLIDING

    def layer_window(self, layer_idx: int) -> int | None:
        """The sliding window layer `layer_idx` attends with (None: full causal)."""
        if self.layer_types and not self.is_sliding_layer(layer_idx):
            return None
        return self.sliding_window

    @property
    def attention_windows(self) -> tuple[int | None, ...]:
        """The distinct windows the layers attend with, in first-layer order."""
        return tuple(dict.fromkeys(self.layer_window(i) for i in range(self.num_hidden_layers)))

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` has a sparse MoE block (else a dense MLP): transformers'
        `mlp_only_layers` / `decoder_sparse_step` rule."""
        return (
            self.num_experts > 0
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each q/k head RoPE rotates (transformers' rounding)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """A parsed `config.json`, as its family reads it; ValueError for an unknown one."""
        from fairbatch.engine.models import read_config  # the families import this module

        return read_config(d)


def read_hf_config(d: dict, architecture: str, rope: tuple | None = None, **fields) -> ModelConfig:
    """A `ModelConfig` from the keys most families read alike: q/k/v and o biases from
    `attention_bias`, the MLP's from `mlp_bias`, a `sliding_window` that binds, SiLU (or the
    `hidden_act` in `fields`). `fields` override those or add to them (q/k norms, experts, ...);
    `rope` is `read_rope`'s result for a family with its own RoPE rules."""
    heads = int(d["num_attention_heads"])
    act, implemented = d.get("hidden_act", "silu"), fields.get("hidden_act", "silu")
    if act != implemented:
        raise NotImplementedError(f"hidden_act={act!r} is not implemented for {architecture}")
    rope_theta, rope_scaling, partial_rotary_factor = rope or read_rope(d, architecture)
    bias = bool(d.get("attention_bias", False))
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
    common = dict(
        {k: int(d[k]) for k in required},
        num_attention_heads=heads,
        num_key_value_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        partial_rotary_factor=partial_rotary_factor,
        max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
        attention_bias=bias,
        o_proj_bias=bias,
        mlp_bias=bool(d.get("mlp_bias", False)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        sliding_window=binding_window(d),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=eos_ids(d.get("eos_token_id")),
        architecture=architecture,
        dtype=d.get("torch_dtype") or d.get("dtype"),
        hidden_act=act,
    )
    return ModelConfig(**{**common, **fields})


def eos_ids(value: int | list[int] | None) -> tuple[int, ...]:
    """`eos_token_id` is an int, a list of ints or absent."""
    values = () if value is None else (value,) if isinstance(value, int) else value
    return tuple(int(v) for v in values)


def binding_window(d: dict) -> int | None:
    """`sliding_window`, or None where it is unset or never binds."""
    window, max_pos = d.get("sliding_window"), int(d.get("max_position_embeddings", 2048))
    return int(window) if window is not None and int(window) < max_pos else None


def switched_window(d: dict, architecture: str) -> None:
    """None for a checkpoint whose `sliding_window` is off unless `use_sliding_window` turns it
    on (past `max_window_layers`: not implemented, so that raises where it would bind)."""
    if d.get("use_sliding_window") and binding_window(d) is not None:
        raise NotImplementedError(f"{architecture} use_sliding_window is not implemented")


def read_rope(
    d: dict, architecture: str, types=ROPE_TYPES, aliases: dict | None = None, partial=False
) -> tuple[float, dict[str, Any] | None, float]:
    """(rope_theta, rope_scaling, partial_rotary_factor), normalised as transformers reads
    them: `types` the family knows (`aliases`: its other names), `partial` rotary or not."""
    max_pos = int(d.get("max_position_embeddings", 2048))
    # transformers 5 writes `rope_parameters` (theta inside); 4.x writes `rope_theta` and an
    # optional `rope_scaling` whose type key is `rope_type` or, older still, `type`.
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", None) or d.get("rope_theta") or 10000.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    rope_type = (aliases or {}).get(rope_type, rope_type)
    # The rope dict's factor wins over a top-level one (transformers' setdefault).
    factor = float(params.pop("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)))
    if rope_type not in types:
        raise NotImplementedError(
            f"rope_type={rope_type!r} is not implemented for {architecture}; supported: {types}"
        )
    if factor != 1.0 and not partial:
        raise NotImplementedError(
            f"partial_rotary_factor != 1 is not implemented for {architecture}"
        )
    if rope_type == "default":
        return theta, None, factor
    if rope_type == "llama3":
        # HF falls back on max_position_embeddings when the original length is not given.
        params.setdefault("original_max_position_embeddings", max_pos)
    if rope_type == "longrope":
        params = _longrope(d, params, max_pos)
    return theta, {"rope_type": rope_type, **params}, factor


def _longrope(d: dict[str, Any], params: dict[str, Any], max_pos: int) -> dict[str, Any]:
    # transformers' _compute_longrope_parameters: a top-level original_max_position_embeddings
    # overrides the rope dict's.
    original = int(
        d.get("original_max_position_embeddings") or params["original_max_position_embeddings"]
    )
    factor = params.get("factor")
    if factor is None:
        factor = max_pos / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    for key in ("short_factor", "long_factor"):
        if not isinstance(params.get(key), list | tuple):
            raise ValueError(f"longrope rope_scaling needs a {key} list")
    return {
        **params,
        "short_factor": tuple(float(f) for f in params["short_factor"]),
        "long_factor": tuple(float(f) for f in params["long_factor"]),
        "original_max_position_embeddings": original,
        "attention_factor": float(attention_factor),
    }
