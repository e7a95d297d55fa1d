"""CUDA checks: the flash backend against the torch reference, and the model on CUDA vs CPU.

Skipped without CUDA; the flash-specific tests also skip without an importable
`vllm_flash_attn` (or on a pre-Ampere GPU). Tolerances: bf16 results are compared with a float32
computation on the same (bf16-rounded) inputs; CUDA float32 is compared with CPU float32 with
TF32 disabled.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fairbatch.engine.attention import (
    AttentionMetadata,
    FlashAttentionBackend,
    TorchAttentionBackend,
    get_attn_backend,
)
from fairbatch.engine.loader import load_hf_model
from fairbatch.engine.models import CausalLM

HAS_CUDA = torch.cuda.is_available()
FLASH_REASON = (
    FlashAttentionBackend.unsupported_reason(torch.device("cuda"), 128, torch.bfloat16)
    if HAS_CUDA
    else "needs CUDA"
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]
needs_flash = pytest.mark.skipif(FLASH_REASON is not None, reason=f"flash: {FLASH_REASON}")

BLOCK_SIZE = 16  # flash reads paged caches only in multiples of 16
# A mixed step: decodes (one with a 1-token context, one long), a prefill without context,
# chunks on top of earlier context, and one long prompt.
Q_LENS = [1, 1, 37, 16, 1, 100, 5, 130]
SEQ_LENS = [1, 300, 37, 80, 17, 100, 260, 130]


@pytest.fixture
def no_tf32() -> Iterator[None]:
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def _tables(seq_lens: list[int], num_blocks: int, seed: int) -> list[list[int]]:
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)  # scattered blocks, so the block tables matter
    return [[free.pop() for _ in range(math.ceil(n / BLOCK_SIZE))] for n in seq_lens]


@needs_flash
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", [None, 24])
def test_flash_matches_torch_backend(head_dim: int, window: int | None) -> None:
    device, dtype = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    heads, kv_heads, num_blocks = 8, 2, 128
    tables = _tables(SEQ_LENS, num_blocks, seed=1)
    meta, _ = AttentionMetadata.build(Q_LENS, SEQ_LENS, tables, BLOCK_SIZE, device=device)
    shape = (2, num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)  # earlier context

    flash = get_attn_backend("flash", device, head_dim=head_dim, dtype=dtype)
    assert isinstance(flash, FlashAttentionBackend)
    reference = TorchAttentionBackend()
    # This step's K/V go in through write_kv, at the slots the metadata names.
    num_tokens = sum(Q_LENS)
    k_new, v_new = torch.randn(2, num_tokens, kv_heads, head_dim, generator=gen, device=device)
    flash.write_kv(k_new.to(dtype), v_new.to(dtype), cache, meta.slot_mapping)
    flat = cache.view(2, -1, kv_heads, head_dim)
    assert torch.equal(flat[0, meta.slot_mapping], k_new.to(dtype))
    assert torch.equal(flat[1, meta.slot_mapping], v_new.to(dtype))

    q = torch.randn(num_tokens, heads, head_dim, generator=gen, device=device, dtype=dtype)
    scale = head_dim**-0.5
    out_flash = flash.forward(q, cache, meta, scale, window)
    # The torch backend reads its own, head-major, order inside a block.
    head_major = cache.permute(0, 1, 3, 2, 4).contiguous()
    out_torch = reference.forward(q, head_major, meta, scale, window)
    exact = reference.forward(q.float(), head_major.float(), meta, scale, window)  # float32 math
    assert out_flash.shape == q.shape and out_flash.dtype == dtype
    torch.testing.assert_close(out_flash.float(), exact, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out_torch.float(), exact, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out_flash, out_torch, atol=3e-2, rtol=3e-2)


@needs_flash
def test_flash_rejects_block_size_not_multiple_of_16() -> None:
    flash = get_attn_backend("flash", "cuda", head_dim=64, dtype=torch.bfloat16)
    meta, _ = AttentionMetadata.build([3], [3], [[0]], block_size=8, device="cuda")
    cache = torch.zeros(2, 4, 8, 2, 64, device="cuda", dtype=torch.bfloat16)
    q = torch.zeros(3, 4, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 16"):
        flash.forward(q, cache, meta, 1.0)


@pytest.fixture(scope="module")
def gpu_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama whose head_dim (64) flash supports; float32, seeded, built offline."""
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.05,
    )
    path = tmp_path_factory.mktemp("gpu_ckpt") / "llama"
    HFLlama(config).to(torch.float32).save_pretrained(path)
    return path


def _two_step_logits(model: CausalLM, device: torch.device) -> torch.Tensor:
    """Logits of two paged steps: first chunks, then the rest (chunks with context + decodes)."""
    totals = [2, 17, 64, 200, 6, 33]
    first = [1, 9, 63, 128, 5, 32]
    rng = random.Random(0)
    tokens = [[rng.randrange(3, 512) for _ in range(n)] for n in totals]
    num_blocks = 64
    tables = _tables(totals, num_blocks, seed=2)
    dtype = next(model.parameters()).dtype
    shape = model.kv_cache_shape(num_blocks, BLOCK_SIZE)
    caches = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(2)]
    logits = []
    for start, upto in (([0] * len(totals), first), (first, totals)):
        q_lens = [u - s for s, u in zip(start, upto)]
        meta, positions = AttentionMetadata.build(q_lens, upto, tables, BLOCK_SIZE, device=device)
        ids = torch.tensor([t for seq, s, u in zip(tokens, start, upto) for t in seq[s:u]])
        hidden = model(ids.to(device), positions, caches, meta)
        logits.append(model.compute_logits(hidden).cpu())
    return torch.cat(logits)  # [sum(totals), vocab] float32


def test_model_cuda_float32_matches_cpu(gpu_ckpt: Path, no_tf32: None) -> None:
    cpu_model, _, _ = load_hf_model(gpu_ckpt)
    cuda_model, _, _ = load_hf_model(gpu_ckpt, device="cuda", dtype=torch.float32)
    assert next(cuda_model.parameters()).device.type == "cuda"
    expected = _two_step_logits(cpu_model, torch.device("cpu"))
    got = _two_step_logits(cuda_model, torch.device("cuda"))
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("backend", ["torch", pytest.param("flash", marks=needs_flash)])
def test_model_cuda_bf16_close_to_cpu(gpu_ckpt: Path, backend: str) -> None:
    cpu_model, _, _ = load_hf_model(gpu_ckpt)
    cuda_model, _, _ = load_hf_model(gpu_ckpt, device="cuda", attn_backend=backend)
    assert next(cuda_model.parameters()).dtype == torch.bfloat16  # the CUDA default
    expected = _two_step_logits(cpu_model, torch.device("cpu"))
    got = _two_step_logits(cuda_model, torch.device("cuda"))
    # Calibrated on CPU: bf16 vs float32 on this model differs by ~0.05 at most, ~0.007 on
    # average, with logits of std ~0.8; the bounds leave 3-4x headroom.
    diff = (got - expected).abs()
    assert diff.max().item() < 0.2, diff.max().item()
    assert diff.mean().item() < 0.03, diff.mean().item()
    agree = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    assert agree > 0.9, agree


def test_auto_backend_on_cuda() -> None:
    expected = "torch" if FLASH_REASON is not None else "flash"
    assert get_attn_backend(None, "cuda", head_dim=64, dtype=torch.bfloat16).name == expected
    # float32 or an odd head_dim always falls back to the torch reference
    assert get_attn_backend(None, "cuda", head_dim=64, dtype=torch.float32).name == "torch"
    assert get_attn_backend(None, "cuda", head_dim=16, dtype=torch.bfloat16).name == "torch"
