"""CUDA: memory profiling, decode CUDA graphs against eager, pinned swap buffers. Skipped
without CUDA; the graph tests also without an importable vllm_flash_attn."""

from __future__ import annotations

import pytest
import torch

from fairbatch.engine.attention import AttentionMetadata, FlashAttentionBackend

HAS_CUDA = torch.cuda.is_available()
FLASH_REASON = (
    FlashAttentionBackend.unsupported_reason(torch.device("cuda"), 32, torch.bfloat16)
    if HAS_CUDA
    else "needs CUDA"
)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]
needs_flash = pytest.mark.skipif(FLASH_REASON is not None, reason=f"flash: {FLASH_REASON}")


def test_memory_profile_and_capped_pool():
    from fairbatch.engine.llm import build_engine
    from fairbatch.engine.memory import max_useful_blocks

    # the tiny model on a big GPU: the budget allows far more blocks than 4 x 256 tokens fill
    engine = build_engine("tiny", device="cuda", max_num_seqs=4, max_model_len=256)
    assert engine.scheduler.kv.gpu_pool.num_blocks == max_useful_blocks(256, 4, 16)


def test_memory_profile_measures_weights_and_activations():
    from fairbatch.engine.memory import profile_cuda_memory
    from fairbatch.engine.tiny import build_tiny
    from fairbatch.kv.cache_engine import KVLayout

    model, config, _ = build_tiny("cuda", attn_backend="torch")
    layout = KVLayout(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, 16,
                      torch.bfloat16, head_major=True)  # fmt: skip
    p = profile_cuda_memory(model, layout, torch.device("cuda"), 2048, 64, 2048)
    weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    assert p.weights >= weight_bytes
    assert p.peak_activations > 0
    assert p.total == torch.cuda.mem_get_info()[1]
    assert 0 <= p.others < p.total


@needs_flash
def test_graph_replay_equals_eager_forward_bitwise():
    from fairbatch.engine.cuda_graphs import INPUT_NAMES, pad_decode_rows
    from fairbatch.engine.llm import build_engine

    engine = build_engine("tiny", device="cuda", num_gpu_blocks=64, max_num_seqs=8)
    runner = engine.runner
    g = runner.graphs
    assert g is not None and g.sizes == [1, 2, 4, 8]
    runner.cache.gpu_cache.normal_()  # some context to attend to
    ids, lens, tables = pad_decode_rows(
        [3, 7, 11], [5, 40, 17], [[1], [2, 3, 4], [9, 10]], 4, g.pad_block
    )
    host = AttentionMetadata.host_inputs([1] * 4, lens, tables, g.block_size, g.width)
    host["ids"] = torch.tensor(ids)
    views = runner.staging.upload([host[k] for k in INPUT_NAMES], out=g.static)
    eager = g._forward(4).clone()  # the same kernels, launched one by one
    replayed = g.replay(4, views[0]).clone()
    assert torch.equal(eager, replayed)


@needs_flash
def test_generate_with_graphs_equals_eager():
    from fairbatch.engine import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [f"graph request {i}" * (1 + i % 3) for i in range(13)]
    eager = LLM("tiny", device="cuda", num_gpu_blocks=512, enforce_eager=True)
    graphs = LLM("tiny", device="cuda", num_gpu_blocks=512, max_num_seqs=16)
    ref, got = eager.generate(prompts, params), graphs.generate(prompts, params)
    assert eager.engine.runner.num_graph_steps == 0
    assert graphs.engine.runner.num_graph_steps > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert graphs.engine.runner.forward_time > 0  # CUDA-event timing was read


def test_swap_reuses_pinned_buffers():
    from fairbatch.kv.cache_engine import CacheEngine, KVLayout

    layout = KVLayout(
        num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16
    )
    ce = CacheEngine(layout, 16, 16, "cuda")
    ce.gpu_cache.normal_()
    before = ce.gpu_cache.clone()
    for _ in range(3):
        ce.swap_out([(1, 2), (5, 6)])
        ce.settle()
        ce.swap_in([(2, 9), (6, 10)])
        torch.cuda.synchronize()
    assert torch.equal(ce.gpu_cache[:, :, 9], before[:, :, 1])
    assert torch.equal(ce.gpu_cache[:, :, 10], before[:, :, 5])
    assert ce.host_buffers.num_allocated == 1  # one pinned buffer served all six copies
