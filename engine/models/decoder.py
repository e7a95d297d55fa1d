"""The decoder every family runs, and its layers: RMSNorm and its offset variant, paged
attention, gated MLPs, sparse mixture-of-experts blocks, the pre-norm decoder layer.

A step's tokens from many sequences (prefill chunks and decode tokens alike) are one flattened
batch: `positions` gives each token's absolute position and `AttentionMetadata` its sequence and
KV slots. Every projection runs once over all tokens; only attention looks at sequence
boundaries. Numerics follow transformers operation for operation (norms in float32, RoPE as
engine/models/rope.py computes it, MoE routing). `CausalLM` is the plain decoder a `ModelConfig`'s
capabilities describe; a family whose model differs subclasses it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from fairbatch.engine.attention import (
    AttentionBackend,
    AttentionMetadata,
    StepPlan,
    StepPlans,
    get_attn_backend,
)
from fairbatch.engine.config import ModelConfig
from fairbatch.engine.models.rope import RotaryEmbedding, apply_rope
from fairbatch.engine.ops import linear, pack_linears

logger = logging.getLogger(__name__)

# Rows of a step the CPU runs through a layer's MLP at once (DecoderLayer.forward).
CPU_MLP_ROWS = 256
# A decoder layer's projections -> the checkpoint tensors each stacks, in row order (HF's names)
PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


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


class OffsetRMSNorm(RMSNorm):
    """RMSNorm whose weight is stored as an offset from 1, applied in float32 before the cast
    back: `(normed * (1 + w)).to(dtype)`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, norm: type[RMSNorm]) -> None:
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
        # q/k norms: over each head's head_dim, one weight shared by all q (k) heads.
        self.q_norm = norm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = norm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

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
        if self.q_norm is not None:  # per head, before RoPE
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


class MLP(nn.Module):
    """Gated MLP: `down(act(gate(x)) * up(x))`, act SiLU (SwiGLU) or `gelu_pytorch_tanh`
    (transformers' GELUTanh: torch's tanh-approximated GELU)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False, act: str = "silu"):
        super().__init__()
        self.gelu = act == "gelu_pytorch_tanh"
        self.intermediate_size = intermediate
        # gate and up fused into one matmul: rows [0, I) gate, [I, 2I) up.
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)  # [T, I] each
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act * up)  # [T, hidden]


class SparseMoeBlock(nn.Module):
    """Top-k routing over `num_experts` SwiGLU experts, as transformers' sparse MoE blocks:
    router logits in the activation dtype, softmax in float32, top-k, optional renormalisation,
    weights cast back, each token's expert outputs summed in ascending expert order.

    The (token, choice) pairs are grouped by expert, each expert (a plain `MLP`) runs once on
    its group's rows and the weighted outputs are added back by token. Group sizes are read on
    the host (one sync per layer), so this block cannot run inside a CUDA graph.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(
            MLP(config.hidden_size, config.moe_intermediate_size) for _ in range(config.num_experts)
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights `[T, k]` (activation dtype) and expert indices `[T, k]` (int64)
        of rows `x [T, hidden]`."""
        logits = self.gate(x)  # [T, E] in the activation dtype, as HF's
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), experts  # back to the activation dtype, as HF casts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "a mixture-of-experts layer cannot be captured in a CUDA graph (its expert "
                "groups have data-dependent sizes); the engine runs such models eagerly"
            )
        weights, experts = self.route(x)
        out = torch.zeros_like(x)
        # Sort the T * k (token, choice) pairs by expert: each expert's rows become one run.
        chosen = experts.flatten()
        order = chosen.argsort(stable=True)
        tokens = order // self.top_k
        pair_weights = weights.flatten()[order, None]
        counts = torch.bincount(chosen, minlength=self.num_experts).tolist()
        start = 0
        for expert, n in zip(self.experts, counts, strict=True):
            if n:
                rows = tokens[start : start + n]
                # The rows are distinct (top-k picks an expert at most once per token), so an
                # indexed add is exact: the scatter-add without index_add_, whose CPU kernel is
                # far slower on small row counts.
                out[rows] += expert(x[rows]) * pair_weights[start : start + n]
            start += n
        return out  # [T, hidden]


class DecoderLayer(nn.Module):
    """Pre-norm: `x + attn(norm(x))`, then `x + mlp(norm(x))`; a subclass changes what each
    block adds to the residual stream through `attn_out` and `ffn`."""

    def __init__(self, config: ModelConfig, layer_idx: int, norm: type[RMSNorm]) -> None:
        super().__init__()
        self.input_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx, norm)
        self.post_attention_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        dense = (config.hidden_size, config.intermediate_size, config.mlp_bias, config.hidden_act)
        self.mlp = SparseMoeBlock(config) if config.is_moe_layer(layer_idx) else MLP(*dense)
        self.local_rope = config.is_sliding_layer(layer_idx)  # turns with the local RoPE
        self.lora = None  # engine/lora.py's LoRAContext, set by attach_lora

    def attn_out(self, h: torch.Tensor) -> torch.Tensor:
        return h

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
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
        x = x + self.attn_out(h)
        lora_step = self.lora is not None and self.lora.groups is not None
        if x.device.type != "cpu" or x.shape[0] <= CPU_MLP_ROWS or lora_step:
            # (a LoRA step's groups are rows of the whole step: not sliced)
            return x + self.ffn(x)
        # A long prefill's MLP on the CPU, a slice of rows at a time: its [rows, 2 * I]
        # intermediates then stay in cache instead of streaming through memory (the same
        # values: every row is computed alone).
        for start in range(0, x.shape[0], CPU_MLP_ROWS):
            part = x[start : start + CPU_MLP_ROWS]
            part += self.ffn(part)
        return x


class CausalLM(nn.Module):
    """A decoder over paged KV caches. `attn_backend`: a name from `ATTENTION_BACKENDS`, or None
    for automatic choice, resolved on the first forward for the device and dtype it runs on. A
    family's subclass may change the norm and layer classes, `embed`, `cache_salt_rule`, and
    `stacked`: which of the engine's projections its checkpoint stores split, under which names."""

    norm_class: type[RMSNorm] = RMSNorm
    layer_class: type[DecoderLayer] = DecoderLayer
    stacked = PROJECTIONS

    @staticmethod
    def cache_salt_rule(config: ModelConfig) -> Callable[[int, str], str] | None:
        """`(num_tokens, salt) -> salt`: the prefix-cache salt of a sequence that long whose
        tenant and adapter salt it `salt`, for a family whose K/V depend on the sequence's
        length too: `salt` up to some length, another one past it. None: always `salt`."""
        return None

    def __init__(self, config: ModelConfig, attn_backend: str | None = "torch") -> None:
        super().__init__()
        if config.attn_logit_softcapping is not None:
            msg = "attn_logit_softcapping=%s is not applied: transformers' %s does not apply "
            msg += "it either, and the engine follows transformers"
            logger.warning(msg, config.attn_logit_softcapping, config.architecture)
        self.config = config
        self.attn_backend_name = attn_backend
        self._backend: AttentionBackend | None = None
        self.model = model = nn.Module()  # HF's `model.` part of the weight names
        model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        model.rotary = RotaryEmbedding(config)  # cos/sin shared by all layers; no parameters
        # Interleaved sliding layers turn with their own base, unscaled (HF's sliding_attention)
        local = replace(config, rope_theta=config.rope_local_theta, rope_scaling=None)
        model.local_rotary = RotaryEmbedding(local) if config.rope_local_theta is not None else None
        layers = range(config.num_hidden_layers)
        model.layers = nn.ModuleList(self.layer_class(config, i, self.norm_class) for i in layers)
        model.norm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        tied = config.tie_word_embeddings  # then the embedding table is the output projection
        self.lm_head = None if tied else nn.Linear(config.hidden_size, config.vocab_size, False)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of ONE layer's cache for this model's attention backend (on the weights'
        device and dtype); allocate `num_hidden_layers` of them."""
        c, backend = self.config, self._weights_backend()
        return backend.kv_cache_shape(num_blocks, block_size, c.num_key_value_heads, c.head_dim)

    def attn_step_plan(
        self, query_lens: list[int], seq_lens: list[int], tables: torch.Tensor, block_size: int
    ) -> StepPlan | None:
        """The backend's host-side plan of one step (for the runner to stage), or None."""
        c, backend = self.config, self._weights_backend()
        step = (query_lens, seq_lens, tables, block_size, c.num_key_value_heads)
        # one plan per distinct window
        plans = [backend.step_plan(*step, c.num_queries_per_kv, w) for w in c.attention_windows]
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

    def _weights_backend(self) -> AttentionBackend:
        p = next(self.parameters())  # resolved as the first forward on these weights would
        return self.attn_backend(p.device, p.dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)  # [T, hidden]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, Hkv, D]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed(input_ids)  # [T, hidden]
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
        params, targets, seen = dict(self.named_parameters()), self.checkpoint_names(), set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue  # old checkpoints saved the RoPE buffer; we recompute it
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the output projection is the embedding
            if name not in targets:
                raise ValueError(f"unexpected tensor {name!r} for {self.config.architecture}")
            target, rows = targets[name]
            dst = params[target][rows]
            if dst.shape != tensor.shape:
                raise ValueError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
                )
            dst.copy_(tensor)
            seen.add(name)
        missing = sorted(set(targets) - seen)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {missing}")

    def checkpoint_names(self) -> dict[str, tuple[str, slice]]:
        """Every tensor the checkpoint holds -> (our parameter, its rows). Ours carry HF's
        names, but the fused projections in `stacked`, which the checkpoint stores split."""
        c = self.config
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        names = {}
        for name, param in self.named_parameters():
            *owner, proj, kind = name.split(".")
            parts = self.stacked.get(proj, (proj,))
            n = len(parts)
            # q, k, v by head counts; else equal parts (gate and up of an MLP or an expert)
            sizes = (q, kv, kv) if proj == "qkv_proj" and n > 1 else [len(param) // n] * n
            start = 0
            for part, size in zip(parts, sizes, strict=True):
                names[".".join([*owner, part, kind])] = (name, slice(start, start + size))
                start += size
        return names
