"""vllm-flash-attn's varlen kernel over the paged cache (CUDA, behind a device check)."""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any

import torch

from fairbatch.engine.attention.base import AttentionBackend, AttentionMetadata

_FLASH_MISSING = "vllm_flash_attn is not importable (install the `gpu` extra on a CUDA machine)"

# Head sizes vllm-flash-attn compiles kernels for (vLLM's FlashAttentionBackend list).
FLASH_HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)


@functools.cache
def _import_flash() -> Any:
    # Cached: a failed import is retried by Python on every call, and this runs per lookup.
    try:
        module = importlib.import_module("vllm_flash_attn")
    except Exception:  # ImportError, or a wheel built for another torch/CUDA failing to load
        return None
    return getattr(module, "flash_attn_varlen_func", None)


class FlashAttentionBackend(AttentionBackend):
    """vllm-flash-attn's varlen kernel reading the paged cache through the block tables (CUDA).

    One kernel call covers the whole mixed batch: `causal=True` aligns the mask bottom-right,
    which is exactly "query i of q_len sits at seq_len - q_len + i". A sliding window is the
    calling layer's own (`window_size`, per call), so interleaved windowed and full layers
    share the cache and block tables; a constant per layer, it captures in a graph.
    No model the engine loads soft-caps attention logits (`attn_logit_softcapping` is read,
    never applied, as in transformers: engine/models/decoder.py), so no `softcap` is passed.
    """

    name = "flash"
    supports_cuda_graphs = True

    def __init__(self) -> None:
        fn = _import_flash()
        if fn is None:
            raise RuntimeError(_FLASH_MISSING)
        self._fn = fn
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            params = {}
        # vLLM's builds take the per-sequence K lengths as `seqused_k`; upstream-style 2.6
        # builds only know cumulative `cu_seqlens_k`. Both describe the same lengths.
        self._seqused_k = "seqused_k" in params or not params

    @classmethod
    def unsupported_reason(
        cls, device: torch.device, head_dim: int | None = None, dtype: torch.dtype | None = None
    ) -> str | None:
        if device.type != "cuda" or not torch.cuda.is_available():
            return f"needs a CUDA device, got {device}"
        if _import_flash() is None:
            return _FLASH_MISSING
        if torch.cuda.get_device_capability(device)[0] < 8:
            return "needs compute capability 8.0 or newer (Ampere+)"
        if head_dim is not None and head_dim not in FLASH_HEAD_DIMS:
            return f"head_dim {head_dim} not in {FLASH_HEAD_DIMS}"
        if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
            return f"needs float16 or bfloat16, got {dtype}"
        return None

    def check_block_size(self, block_size: int) -> None:
        if block_size % 16:
            raise ValueError(f"flash attention needs a block_size multiple of 16, got {block_size}")

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,  # this step's K, V [T, Hkv, D]
    ) -> torch.Tensor:
        self.check_block_size(kv_cache.shape[2])
        kwargs: dict[str, Any] = {}
        if self._seqused_k:
            kwargs["seqused_k"] = meta.seq_lens
        else:
            cu = meta._cache.get("cu_seqlens_k")
            if cu is None:
                cu = torch.zeros(meta.num_seqs + 1, dtype=torch.int32, device=q.device)
                cu[1:] = torch.cumsum(meta.seq_lens, 0)
                meta._cache["cu_seqlens_k"] = cu
            kwargs["cu_seqlens_k"] = cu
        if sliding_window is not None:
            kwargs["window_size"] = (sliding_window - 1, 0)  # p - (w - 1) .. p, as HF masks
        return self._fn(
            q=q,
            k=kv_cache[0],  # [num_blocks, block_size, num_kv_heads, head_dim]
            v=kv_cache[1],
            cu_seqlens_q=meta.query_start_loc,
            max_seqlen_q=meta.max_query_len,
            max_seqlen_k=meta.max_seq_len,
            softmax_scale=scale,
            causal=True,
            block_table=meta.block_tables,
            **kwargs,
        )
