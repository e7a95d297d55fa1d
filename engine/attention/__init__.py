"""Paged attention over one flattened step: metadata, and backends chosen through a registry.

A step concatenates the new tokens of many sequences (prefill chunks and single decode tokens
alike) into one batch of `num_tokens` rows. Sequence `s` owns rows
`query_start_loc[s] .. query_start_loc[s + 1]`; its context is `seq_lens[s]` tokens, this step's
included, so its query `i` of `q_len` sits at absolute position `seq_len - q_len + i` and sees keys
`0 ..` that position (fewer with a sliding window).

KV cache, one tensor per layer, index 0 the keys, 1 the values. Token position `p` of a sequence
lives in block `block_table[p // block_size]` at offset `p % block_size`, i.e. flat slot
`block_id * block_size + offset`. Inside a block the backend picks the order
(`kv_cache_shape`): the flash backend's is `[2, num_blocks, block_size, num_kv_heads, head_dim]`,
the layout vllm-flash-attn reads; the torch backend's is head-major,
`[2, num_blocks, num_kv_heads, block_size, head_dim]`, so a gather of whole (block, head) tiles
lands directly in the `[heads, length, dim]` order SDPA reads fastest. Swaps and migration move
whole blocks and never look inside one.

Contract of a backend (one instance per model serves every layer; it may keep scratch buffers):
* `write_kv(key, value, kv_cache, slot_mapping)` stores this step's K/V; every slot is valid
  (no padding slots), and it runs before `forward` reads the cache.
* `forward(q, kv_cache, meta, scale, sliding_window)` -> `[num_tokens, num_heads, head_dim]`,
  attending only to the first `seq_lens[s]` positions of each sequence. The torch backend reads
  decode context as whole blocks and masks the tail, so unwritten slots must hold finite values
  (the cache engine zero-fills; K/V written later are the model's own).
  `sliding_window` is the calling layer's own (a model may interleave windowed and full layers
  over the same cache and block tables); a model with several windows stages one step plan
  per window (`StepPlans`).

Modules: `base.py` (the step's metadata, the per-step plan and the backend contract),
`torch_backend.py` (the reference backend, CPU and CUDA), `flash.py` (vllm-flash-attn, CUDA);
the registry is here.
"""

from __future__ import annotations

import torch

from fairbatch.engine.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    StepPlan,
    StepPlans,
)
from fairbatch.engine.attention.flash import FLASH_HEAD_DIMS, FlashAttentionBackend
from fairbatch.engine.attention.torch_backend import DECODE_GROUP, TorchAttentionBackend

__all__ = [
    "ATTENTION_BACKENDS",
    "DECODE_GROUP",
    "FLASH_HEAD_DIMS",
    "AttentionBackend",
    "AttentionMetadata",
    "FlashAttentionBackend",
    "StepPlan",
    "StepPlans",
    "TorchAttentionBackend",
    "get_attn_backend",
]

ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    "torch": TorchAttentionBackend,
    "flash": FlashAttentionBackend,
}


def get_attn_backend(
    name: str | None,
    device: torch.device | str,
    *,
    head_dim: int | None = None,
    dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """The backend called `name`; None (or "auto"): flash where it can run, else torch.

    `head_dim` and `dtype`, when given, are checked too, so "auto" never picks a backend that
    would fail on the first forward.
    """
    device = torch.device(device)
    if name is None or name == "auto":
        usable = FlashAttentionBackend.unsupported_reason(device, head_dim, dtype) is None
        name = "flash" if usable else "torch"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(ATTENTION_BACKENDS)}")
    backend_cls = ATTENTION_BACKENDS[name]
    reason = backend_cls.unsupported_reason(device, head_dim, dtype)
    if reason is not None:
        raise ValueError(f"attention backend {name!r} cannot run here: {reason}")
    return backend_cls()
