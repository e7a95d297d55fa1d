"""Llama-family decoder (Llama, Qwen2, Mistral, Qwen3, Qwen3-MoE, Phi3, Gemma 3) over one
flattened, paged batch.

A step's tokens from many sequences (prefill chunks and decode tokens alike) are concatenated
into `[num_tokens]`; `positions` gives each token's absolute position and `AttentionMetadata`
says which sequence it belongs to and where its K/V go. Every projection runs once over all
tokens; only attention looks at sequence boundaries.

Numerics follow transformers token for token: RMSNorm in float32, RoPE as engine/rope.py
computes it (partial rotary and longrope included). Qwen3's q/k norms run per head on the
projections, before RoPE, as transformers' Qwen3Attention does. Qwen3-MoE's sparse blocks live
in engine/mlp.py. Phi3 is this decoder with its checkpoint's fused qkv_proj / gate_up_proj
loaded as they are (their rows are already in our order: q, k, v and gate, up).

Gemma 3 (`config.gemma`), as transformers' Gemma3ForCausalLM computes it: embeddings times
sqrt(hidden_size) (rounded to float32, then to the activation dtype, as HF's buffer is); every
RMSNorm scales by `1 + w` (`GemmaRMSNorm`, in float32); a norm on the attention output and
another pair around the MLP (GELU-tanh); q/k norms per head; attention scale
`query_pre_attn_scalar ** -0.5`; sliding layers attend with `sliding_window` and turn with the
local RoPE base, global layers attend to everything and turn with `rope_theta` (+ scaling);
final logits soft-capped. `attn_logit_softcapping` is not applied: transformers' Gemma3
attention never passes it to its attention functions (a config that sets it logs a warning).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import replace

import torch
from torch import nn

from fairbatch.engine.attention import (
    AttentionBackend,
    AttentionMetadata,
    StepPlan,
    StepPlans,
    get_attn_backend,
)
from fairbatch.engine.config import FUSED_CHECKPOINTS, ModelConfig
from fairbatch.engine.mlp import MLP, SparseMoeBlock
from fairbatch.engine.ops import linear, pack_linears
from fairbatch.engine.rope import RotaryEmbedding, apply_rope, rope_inv_freq

__all__ = ["LlamaForCausalLM", "RotaryEmbedding", "apply_rope", "rope_inv_freq"]

logger = logging.getLogger(__name__)

# Rows of a step the CPU runs through a layer's MLP at once (DecoderLayer.forward).
CPU_MLP_ROWS = 256


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 even for bf16 activations, as HF does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the weight is stored as an offset from 1 and applied in float32
    before the cast back (transformers' Gemma3RMSNorm, operation for operation)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


def _norm(config: ModelConfig, size: int) -> RMSNorm:
    return (GemmaRMSNorm if config.gemma else RMSNorm)(size, config.rms_norm_eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        scalar = config.query_pre_attn_scalar
        self.scale = self.head_dim**-0.5 if scalar is None else scalar**-0.5
        self.sliding_window = config.layer_window(layer_idx)
        # q, k and v fused into one matmul; load_weights fills the three row ranges.
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        # Qwen3: RMSNorm over each head's head_dim, one weight shared by all q (k) heads.
        self.q_norm = _norm(config, self.head_dim) if config.qk_norm else None
        self.k_norm = _norm(config, self.head_dim) if config.qk_norm else None

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [T, 1, rotary_dim]
        x: torch.Tensor,  # [T, hidden]
        kv_cache: torch.Tensor,  # [2, num_blocks, ...]: the backend's kv_cache_shape
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        qk = qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim)  # [T, H + Hkv, D]
        if self.q_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        # q and k rotate alike: one RoPE over their heads side by side
        qk = apply_rope(qk, *rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [T, H, D], [T, Hkv, D]
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        # Write first: attention reads this step's keys back from the cache with the context.
        backend.write_kv(k, v, kv_cache, meta.slot_mapping)
        # [T, H, D]; the new K/V go along so a backend may skip re-reading a fresh prompt's
        out = backend.forward(q, kv_cache, meta, self.scale, self.sliding_window, new_kv=(k, v))
        return self.o_proj(out.reshape(t, self.q_size))  # [T, hidden]


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = _norm(config, config.hidden_size)
        self.self_attn = Attention(config, layer_idx)
        # Gemma: the norm of the attention output; the others: the norm before the MLP
        self.post_attention_layernorm = _norm(config, config.hidden_size)
        self.mlp: nn.Module = (
            SparseMoeBlock(config)
            if config.is_moe_layer(layer_idx)
            else MLP(
                config.hidden_size,
                config.intermediate_size,
                bias=config.mlp_bias,
                act=config.hidden_act,
            )
        )
        self.local_rope = config.is_sliding_layer(layer_idx)  # Gemma's sliding layers
        self.gemma = config.gemma
        if config.gemma:  # Gemma's sandwich norms around the MLP
            self.pre_feedforward_layernorm = _norm(config, config.hidden_size)
            self.post_feedforward_layernorm = _norm(config, config.hidden_size)
        self.lora = None  # engine/lora.py's LoRAContext, set by attach_lora

    def _ffn(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemma:
            return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return self.mlp(self.post_attention_layernorm(x))

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        x: torch.Tensor,  # [T, hidden]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        h = self.self_attn(rope, self.input_layernorm(x), kv_cache, meta, backend)
        x = x + (self.post_attention_layernorm(h) if self.gemma else h)
        lora_step = self.lora is not None and self.lora.groups is not None
        if x.device.type != "cpu" or x.shape[0] <= CPU_MLP_ROWS or lora_step:
            # (a LoRA step's groups are rows of the whole step: not sliced)
            return x + self._ffn(x)
        # A long prefill's MLP on the CPU, a slice of rows at a time: its [rows, 2 * I]
        # intermediates then stay in cache instead of streaming through memory (the same
        # values: every row is computed alone).
        for start in range(0, x.shape[0], CPU_MLP_ROWS):
            part = x[start : start + CPU_MLP_ROWS]
            part += self._ffn(part)
        return x


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config)  # cos/sin shared by all layers; no parameters
        # Gemma's sliding layers turn with their own base, unscaled (HF's sliding_attention)
        self.local_rotary = (
            RotaryEmbedding(replace(config, rope_theta=config.rope_local_theta, rope_scaling=None))
            if config.rope_local_theta is not None
            else None
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = _norm(config, config.hidden_size)
        # Gemma: sqrt(hidden) as HF's float32 buffer holds it (cast per activation dtype)
        self.embed_scale = (
            float(torch.tensor(config.hidden_size**0.5, dtype=torch.float32, device="cpu"))
            if config.gemma
            else None
        )


class LlamaForCausalLM(nn.Module):
    """Llama / Qwen2 / Mistral / Qwen3 / Qwen3-MoE / Phi3 / Gemma 3 for inference over paged
    KV caches.

    `attn_backend`: a name from `ATTENTION_BACKENDS`, or None for automatic choice; it is
    resolved on the first forward, against the device and dtype the model then runs on.
    """

    def __init__(self, config: ModelConfig, attn_backend: str | None = "torch") -> None:
        super().__init__()
        if config.attn_logit_softcapping is not None:
            logger.warning(
                "attn_logit_softcapping=%s is not applied: transformers' %s does not apply "
                "it either, and the engine follows transformers",
                config.attn_logit_softcapping,
                config.architecture,
            )
        self.config = config
        self.attn_backend_name = attn_backend
        self._backend: AttentionBackend | None = None
        self.model = LlamaModel(config)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of ONE layer's cache for this model's attention backend (on the weights'
        device and dtype); allocate `num_hidden_layers` of them."""
        c = self.config
        p = next(self.parameters())
        backend = self.attn_backend(p.device, p.dtype)
        return backend.kv_cache_shape(num_blocks, block_size, c.num_key_value_heads, c.head_dim)

    def attn_step_plan(
        self,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables_cpu: torch.Tensor,
        block_size: int,
    ) -> StepPlan | None:
        """The backend's host-side plan of one step (for the runner to stage), or None."""
        c = self.config
        if self._backend is None:  # resolved as the first forward would resolve it
            p = next(self.parameters())
            self.attn_backend(p.device, p.dtype)
        plans = [
            self._backend.step_plan(
                query_lens,
                seq_lens,
                block_tables_cpu,
                block_size,
                c.num_key_value_heads,
                c.num_attention_heads // c.num_key_value_heads,
                window,
            )  # fmt: skip
            for window in c.attention_windows  # one per distinct window (Gemma: two)
        ]
        plans = [p for p in plans if p is not None]
        if len(plans) <= 1:
            return plans[0] if plans else None
        return StepPlans(plans)

    def pack_for_cpu(self) -> None:
        """Run the linear layers through oneDNN with prepacked weights (engine/ops.py); on
        the CPU only, after the weights are loaded. The tied output projection keeps reading
        the embedding table (`compute_logits`)."""
        pack_linears(self)

    def attn_backend(self, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
        if self._backend is None:
            self._backend = get_attn_backend(
                self.attn_backend_name, device, head_dim=self.config.head_dim, dtype=dtype
            )
        return self._backend

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, Hkv, D]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        if self.model.embed_scale is not None:
            # HF multiplies by its float32 buffer cast to the weights' dtype: a python float of
            # that value scales alike (and keeps a captured graph free of host copies)
            scale = torch.tensor(self.model.embed_scale, dtype=x.dtype, device="cpu")
            x = x * float(scale)
        backend = self.attn_backend(x.device, x.dtype)
        rope = self.model.rotary(positions, x.dtype)
        local = self.model.local_rotary
        local_rope = local(positions, x.dtype) if local is not None else rope
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(local_rope if layer.local_rope else rope, x, kv_cache, attn_metadata, backend)
        return self.model.norm(x)  # [T, hidden]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden [n, hidden] -> [n, vocab] float32; callers pass only the rows they sample.
        if self.lm_head is not None:
            logits = self.lm_head(hidden)
        else:
            logits = linear(hidden, self.model.embed_tokens.weight)
        cap = self.config.final_logit_softcapping
        if cap is not None:  # in the activation dtype, as HF caps
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in; raise naming every expected tensor that never came."""
        params = dict(self.named_parameters())
        expected = set(self._hf_names())
        seen: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue  # old checkpoints saved the RoPE buffer; we recompute it
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the output projection is the embedding
            if name not in expected:
                raise ValueError(f"unexpected tensor {name!r} for {self.config.architecture}")
            target, rows = self._target(name)
            dst = params[target] if rows is None else params[target][rows[0] : rows[1]]
            if dst.shape != tensor.shape:
                raise ValueError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
                )
            dst.copy_(tensor)
            seen.add(name)
        missing = sorted(expected - seen)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {missing}")

    def _hf_names(self) -> list[str]:
        c = self.config
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if self.lm_head is not None:
            names.append("lm_head.weight")
        if c.architecture in FUSED_CHECKPOINTS:  # stored as we hold them: no biases
            projections = [("self_attn", p, False) for p in ("qkv_proj", "o_proj")]
            dense = [("mlp", p, False) for p in ("gate_up_proj", "down_proj")]
        else:
            qkv = ("q_proj", "k_proj", "v_proj")
            projections = [("self_attn", p, c.attention_bias) for p in qkv]
            projections.append(("self_attn", "o_proj", c.o_proj_bias))
            dense = [("mlp", p, c.mlp_bias) for p in ("gate_proj", "up_proj", "down_proj")]
        # A sparse layer: the router, then each expert's SwiGLU (HF's per-expert names).
        sparse = [("mlp", "gate", False)] + [
            (f"mlp.experts.{e}", p, False)
            for e in range(c.num_experts)
            for p in ("gate_proj", "up_proj", "down_proj")
        ]
        for i in range(c.num_hidden_layers):
            prefix = f"model.layers.{i}"
            names += [
                f"{prefix}.input_layernorm.weight",
                f"{prefix}.post_attention_layernorm.weight",
            ]
            if c.qk_norm:
                names += [f"{prefix}.self_attn.q_norm.weight", f"{prefix}.self_attn.k_norm.weight"]
            if c.gemma:
                names += [
                    f"{prefix}.pre_feedforward_layernorm.weight",
                    f"{prefix}.post_feedforward_layernorm.weight",
                ]
            mlp = sparse if c.is_moe_layer(i) else dense
            for module, proj, bias in projections + mlp:
                names.append(f"{prefix}.{module}.{proj}.weight")
                if bias:
                    names.append(f"{prefix}.{module}.{proj}.bias")
        return names

    def _target(self, hf_name: str) -> tuple[str, tuple[int, int] | None]:
        # HF name -> (our parameter, row range inside it for the fused projections)
        c = self.config
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        inter = c.moe_intermediate_size if ".experts." in hf_name else c.intermediate_size
        fused = {
            "q_proj": ("qkv_proj", (0, q)),
            "k_proj": ("qkv_proj", (q, q + kv)),
            "v_proj": ("qkv_proj", (q + kv, q + 2 * kv)),
            "gate_proj": ("gate_up_proj", (0, inter)),
            "up_proj": ("gate_up_proj", (inter, 2 * inter)),
        }
        parts = hf_name.split(".")
        if len(parts) >= 2 and parts[-2] in fused:
            ours, rows = fused[parts[-2]]
            return ".".join([*parts[:-2], ours, parts[-1]]), rows
        return hf_name, None
