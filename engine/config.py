"""The shape of a Llama-family model, read from a Hugging Face `config.json`.

Qwen3 adds a per-head RMSNorm on q and k (`qk_norm`); Qwen3-MoE also replaces some layers'
MLPs by sparse mixture-of-experts blocks (`num_experts` > 0, layers picked by `is_moe_layer`).
Phi-3 / Phi-4-mini (`Phi3ForCausalLM`) store q/k/v and gate/up fused in the checkpoint (the
engine's own layout), rotate only the first `rotary_dim` of each head (`partial_rotary_factor`)
and may scale RoPE with `longrope` (engine/rope.py says which factor set a token gets).
Gemma 3's text model (`Gemma3ForCausalLM`, model_type `gemma3_text`) interleaves sliding-window
and global layers (`layer_types`), each kind with its own RoPE base (`rope_local_theta` on the
sliding layers), and adds what `gemma` switches on in engine/model.py: `(1 + w)` norms, the
sandwich norms around attention and MLP, the sqrt(hidden) embedding scale, GELU-tanh,
`query_pre_attn_scalar` and final logit soft-capping. Its `attn_logit_softcapping` is read but
not applied, as transformers' Gemma3 does not apply it either (engine/model.py warns).

A pure dataclass: building one never touches the disk, so the scheduler, the simulated runner and
tests can describe a model without a checkpoint. `from_hf_dict` takes the parsed `config.json`
(both the transformers 4.x layout, `rope_theta` + `rope_scaling`, and the 5.x layout,
`rope_parameters`) and normalises it.

Sliding-window attention (Mistral, Phi3: every layer; Gemma 3: its sliding layers, `layer_window`):
implemented. A window `w` means query position `p` sees keys `p - w + 1 .. p`, as Hugging Face
masks it. A window at least as long as
`max_position_embeddings` can never bind, so it is dropped. The Qwen families'
`use_sliding_window` (Qwen2/Qwen3: windows on the layers past `max_window_layers`) is not
implemented and raises.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# Architecture name in `config.json` -> HF `model_type`; one decoder (engine/model.py) runs
# them all, the differences being flags of ModelConfig.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Phi3ForCausalLM": "phi3",
    "Gemma3ForCausalLM": "gemma3_text",
}
QWEN3_FAMILY = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# Checkpoints that store `qkv_proj` and `gate_up_proj` fused, rows in the engine's order.
FUSED_CHECKPOINTS = ("Phi3ForCausalLM",)
# rope_type values whose inv_freq we compute exactly as transformers does, per architecture
# (transformers' Phi3Config accepts only these two; "su" and "yarn" are its old longrope names).
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")
PHI3_ROPE_TYPES = ("default", "longrope")
PHI3_DEFAULTS = {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096}
GEMMA3 = "Gemma3ForCausalLM"
# Gemma3TextConfig's defaults (a published config.json writes all of them).
GEMMA3_DEFAULTS = {
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131072,
    "head_dim": 256,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "hidden_activation": "gelu_pytorch_tanh",
}
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
    # (longrope's normalised by `_rope`: short/long factors, original length, attention factor).
    rope_scaling: dict[str, Any] | None = None
    partial_rotary_factor: float = 1.0  # RoPE turns the first `rotary_dim` of each head only
    max_position_embeddings: int = 2048
    attention_bias: bool = False  # bias on q/k/v projections
    o_proj_bias: bool = False  # bias on the output projection (Llama's attention_bias sets both)
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # None: full causal attention
    # Per layer, SLIDING or FULL (Gemma 3): only SLIDING layers use `sliding_window` and turn
    # with `rope_local_theta`. Empty: every layer uses `sliding_window` (Mistral, Phi3).
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (Qwen3)
    # Mixture of experts (Qwen3-MoE); num_experts 0 means every layer has a dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    mlp_only_layers: tuple[int, ...] = ()  # layers that keep a dense MLP
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0
    # Gemma 3 (see the module docstring); the others keep these defaults.
    gemma: bool = False
    hidden_act: str = "silu"  # "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU, Gemma)
    query_pre_attn_scalar: float | None = None  # attention scale scalar**-0.5, not head_dim's
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    attn_logit_softcapping: float | None = None  # read, never applied (as transformers)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "LlamaForCausalLM"
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
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(_unsupported(self.architecture))
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
                f"hidden_act={self.hidden_act!r}: only 'silu' and 'gelu_pytorch_tanh' are "
                "implemented"
            )

    def is_sliding_layer(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` is a sliding layer of an interleaved model (Gemma 3): its
        window is `sliding_window` and it turns with `rope_local_theta`."""
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
        """Whether layer `layer_idx` has a sparse MoE block (else a dense MLP), the rule of
        transformers' Qwen3MoeDecoderLayer."""
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
        architecture = _architecture(d)
        if architecture == "Phi3ForCausalLM":
            d = {**PHI3_DEFAULTS, **d}  # Phi3Config's defaults where they differ from ours
        if architecture == GEMMA3:
            d = {**GEMMA3_DEFAULTS, **{k: v for k, v in d.items() if v is not None}}
        max_pos = int(d.get("max_position_embeddings", 2048))
        hidden = int(d["hidden_size"])
        num_heads = int(d["num_attention_heads"])

        # Gemma3 reads `hidden_activation` only (a `hidden_act` beside it is ignored, as HF does)
        act = d["hidden_activation"] if architecture == GEMMA3 else d.get("hidden_act", "silu")
        if act != ("gelu_pytorch_tanh" if architecture == GEMMA3 else "silu"):
            raise NotImplementedError(f"hidden_act={act!r} is not implemented for {architecture}")
        gemma = _gemma3(d) if architecture == GEMMA3 else {}
        rope_theta, rope_scaling, partial_rotary_factor = _rope(
            gemma.pop("global_rope", d), max_pos, architecture
        )

        if architecture == "Qwen2ForCausalLM":
            qkv_bias, o_bias, mlp_bias = True, False, False  # Qwen2 always has qkv bias
        elif architecture == "MistralForCausalLM":
            qkv_bias, o_bias, mlp_bias = False, False, False
        elif architecture == "Phi3ForCausalLM":
            qkv_bias, o_bias, mlp_bias = False, False, False  # Phi3 has no bias, whatever it says
        elif architecture in (*QWEN3_FAMILY, GEMMA3):
            qkv_bias = o_bias = bool(d.get("attention_bias", False))  # one flag, all four
            mlp_bias = False
        else:
            qkv_bias = o_bias = bool(d.get("attention_bias", False))
            mlp_bias = bool(d.get("mlp_bias", False))

        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(d.get("head_dim") or _default_head_dim(architecture, hidden, num_heads)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            partial_rotary_factor=partial_rotary_factor,
            max_position_embeddings=max_pos,
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            mlp_bias=mlp_bias,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            sliding_window=_sliding_window(d, architecture, max_pos),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids(d.get("eos_token_id")),
            architecture=architecture,
            dtype=d.get("torch_dtype") or d.get("dtype"),
            qk_norm=architecture in (*QWEN3_FAMILY, GEMMA3),
            hidden_act=act,
            **_moe(d, architecture),
            **gemma,
        )


def eos_ids(value: int | list[int] | None) -> tuple[int, ...]:
    """`eos_token_id` is an int, a list of ints (Llama 3.1) or absent."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _unsupported(name: str) -> str:
    return f"unsupported architecture {name!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"


def _architecture(d: dict[str, Any]) -> str:
    names = d.get("architectures") or []
    if names:
        if names[0] not in SUPPORTED_ARCHITECTURES:
            raise ValueError(_unsupported(names[0]))
        return names[0]
    # A config built in code (not from a model) has no `architectures`; fall back on model_type.
    by_type = {t: a for a, t in SUPPORTED_ARCHITECTURES.items()}
    model_type = d.get("model_type")
    if model_type not in by_type:
        raise ValueError(_unsupported(f"model_type={model_type}"))
    return by_type[model_type]


def _default_head_dim(architecture: str, hidden: int, num_heads: int) -> int:
    # Qwen3's config class defaults head_dim to 128 rather than deriving it (its checkpoints
    # always write it; a dict built in code may not).
    return 128 if architecture in QWEN3_FAMILY else hidden // num_heads


def _gemma3(d: dict[str, Any]) -> dict[str, Any]:
    """Gemma3TextConfig's layer pattern, local RoPE base and scalars, read as transformers
    reads them; `global_rope` is the config `_rope` reads for the global layers."""
    if d.get("use_bidirectional_attention"):
        raise NotImplementedError("Gemma3 use_bidirectional_attention is not implemented")
    layers = int(d["num_hidden_layers"])
    types = d.get("layer_types")
    if types is None:  # the older config.json: every `sliding_window_pattern`-th layer global
        pattern = int(d.get("sliding_window_pattern", 6))
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
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
    softcap = {k: d.get(k) for k in ("final_logit_softcapping", "attn_logit_softcapping")}
    return dict(
        layer_types=tuple(types),
        rope_local_theta=float(local["rope_theta"]),
        gemma=True,
        query_pre_attn_scalar=float(d["query_pre_attn_scalar"]),
        **{k: None if v is None else float(v) for k, v in softcap.items()},
        global_rope=global_rope,
    )


def _moe(d: dict[str, Any], architecture: str) -> dict[str, Any]:
    if architecture != "Qwen3MoeForCausalLM":
        return {}
    # transformers 5 saves `num_experts` under its attribute_map name `num_local_experts`;
    # the published checkpoints write `num_experts`.
    num_experts = int(d.get("num_experts", d.get("num_local_experts", 128)))  # HF's default
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=int(d.get("num_experts_per_tok", 8)) if num_experts else 0,
        moe_intermediate_size=int(d.get("moe_intermediate_size", 768)),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()),
        decoder_sparse_step=int(d.get("decoder_sparse_step", 1)),
    )


def _rope(
    d: dict[str, Any], max_pos: int, architecture: str
) -> tuple[float, dict[str, Any] | None, float]:
    """(rope_theta, rope_scaling, partial_rotary_factor), normalised as transformers reads
    them."""
    # transformers 5 writes `rope_parameters` (theta inside); 4.x writes `rope_theta` and an
    # optional `rope_scaling` whose type key is `rope_type` or, older still, `type`.
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", None) or d.get("rope_theta") or 10000.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    # The rope dict's factor wins over a top-level one (transformers' setdefault).
    partial = float(params.pop("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)))
    phi3 = architecture == "Phi3ForCausalLM"
    if phi3 and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # Phi3Config's backward-compatible names
    supported = PHI3_ROPE_TYPES if phi3 else SUPPORTED_ROPE_TYPES
    if rope_type not in supported:
        raise NotImplementedError(
            f"rope_type={rope_type!r} is not implemented for {architecture}; supported: {supported}"
        )
    if partial != 1.0 and not phi3:
        raise NotImplementedError(
            f"partial_rotary_factor != 1 is not implemented for {architecture}"
        )
    if rope_type == "default":
        return theta, None, partial
    if rope_type == "llama3":
        # HF falls back on max_position_embeddings when the original length is not given.
        params.setdefault("original_max_position_embeddings", max_pos)
    if rope_type == "longrope":
        params = _longrope(d, params, max_pos)
    return theta, {"rope_type": rope_type, **params}, partial


def _longrope(d: dict[str, Any], params: dict[str, Any], max_pos: int) -> dict[str, Any]:
    # transformers' _compute_longrope_parameters and Phi3Config: the top-level
    # original_max_position_embeddings (Phi3Config's default 4096) overrides the rope dict's.
    original = int(d.get("original_max_position_embeddings", 4096))
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


def _sliding_window(d: dict[str, Any], architecture: str, max_pos: int) -> int | None:
    window = d.get("sliding_window")
    if architecture in ("Qwen2ForCausalLM", *QWEN3_FAMILY):
        # Qwen checkpoints carry a window that is off unless use_sliding_window says so.
        if d.get("use_sliding_window") and window is not None and window < max_pos:
            raise NotImplementedError(f"{architecture} use_sliding_window is not implemented")
        return None
    windowed = ("MistralForCausalLM", "Phi3ForCausalLM", GEMMA3)
    if architecture in windowed and window is not None and int(window) < max_pos:
        return int(window)
    return None  # Llama has no window; a window >= max_position_embeddings never binds
