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


# Every sampling feature and prompt logprobs: a step's whole path to the host.
MIXED = [
    dict(temperature=0, logprobs=2, prompt_logprobs=1),
    dict(temperature=0.8, top_k=5, top_p=0.9),
    dict(temperature=1.0, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.3,
         repetition_penalty=1.2, logprobs=0),
    dict(temperature=0, logit_bias={7: 4.0, 9: -100.0}, prompt_logprobs=0),
    dict(temperature=0.7, seed=11, logprobs=1),
    dict(temperature=0),
]  # fmt: skip


def _mixed_params():
    from fairbatch.engine import SamplingParams

    return [SamplingParams(max_tokens=8, ignore_eos=True, **kw) for kw in MIXED]


@pytest.mark.parametrize(
    ("backend", "enforce_eager"),
    [("torch", True), pytest.param("flash", False, marks=needs_flash)],
)
def test_steady_steps_wait_for_the_device_only_to_read_results(backend, enforce_eager):
    """torch's sync debug mode raises on every hidden host wait (`.item()`, pageable copies,
    stream syncs); the one read per step waits on an event, which it does not flag."""
    from fairbatch.engine import LLM

    llm = LLM("tiny", device="cuda", attn_backend=backend, num_gpu_blocks=512, max_num_seqs=8,
              max_num_batched_tokens=64, enforce_eager=enforce_eager)  # fmt: skip
    prompts = [f"sync check {i} " * (1 + 3 * i) for i in range(len(MIXED))]
    ref = llm.generate(prompts, _mixed_params(), use_tqdm=False)  # warm-up: first allocations
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = llm.generate(prompts, _mixed_params(), use_tqdm=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    greedy = [i for i, kw in enumerate(MIXED) if kw["temperature"] == 0 or "seed" in kw]
    assert [got[i].token_ids for i in greedy] == [ref[i].token_ids for i in greedy]
    assert (llm.engine.runner.num_graph_steps > 0) == (not enforce_eager)


def test_torch_backend_staged_plan_equals_the_plain_path():
    from fairbatch.engine import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=1)
    prompts = [f"plan check {i} " * (1 + i % 5) for i in range(9)]
    staged = LLM("tiny", device="cuda", attn_backend="torch", num_gpu_blocks=512)
    plain = LLM("tiny", device="cuda", attn_backend="torch", num_gpu_blocks=512)
    plain.engine.runner.staging = None  # plain tensors, the backend's own plan copy
    got, ref = staged.generate(prompts, params), plain.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert [o.prompt_logprobs for o in got] == [o.prompt_logprobs for o in ref]
    assert staged.engine.runner.staging.num_uploads == staged.engine.runner.num_steps


@needs_flash
def test_measured_graph_memory_matches_the_real_capture():
    from fairbatch.engine.memory import measure_graph_memory
    from fairbatch.engine.runner import ModelRunner
    from fairbatch.engine.tiny import build_tiny
    from fairbatch.kv.cache_engine import CacheEngine, KVLayout

    model, config, _ = build_tiny("cuda", attn_backend="flash")
    layout = KVLayout(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, 16,
                      torch.bfloat16)  # fmt: skip
    dev = torch.device("cuda")
    measured = measure_graph_memory(model, layout, dev, 32, 1024)
    runner = ModelRunner(model, CacheEngine(layout, 256, 0, dev, pad_block=True))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info()[0]
    runner.capture_decode_graphs(32, 1024)
    torch.cuda.empty_cache()
    real = free_before - torch.cuda.mem_get_info()[0]
    assert measured > 0
    # the measurement also counts the one pad block; allow the driver's 2 MiB granularity
    assert abs(real - measured) <= max(measured // 10, 4 << 20), (real, measured)


@needs_flash
def test_build_engine_sets_the_graphs_memory_aside(monkeypatch):
    import dataclasses

    import fairbatch.engine.llm as llm_mod
    from fairbatch.engine.memory import kv_cache_budget

    profiles = []
    real = llm_mod.profile_cuda_memory

    def spy(*args, **kwargs):
        profiles.append(real(*args, **kwargs))
        return profiles[-1]

    monkeypatch.setattr(llm_mod, "profile_cuda_memory", spy)
    llm_mod.build_engine("tiny", device="cuda", max_num_seqs=16, enforce_eager=True)
    llm_mod.build_engine("tiny", device="cuda", max_num_seqs=16)
    eager, graphs = profiles
    assert eager.cuda_graphs == 0 and graphs.cuda_graphs > 0
    without = dataclasses.replace(graphs, cuda_graphs=0)
    assert kv_cache_budget(graphs, 0.9) == kv_cache_budget(without, 0.9) - graphs.cuda_graphs
