"""The CPU-testable parts of the GPU path: KV sizing arithmetic, build-time checks, CUDA graph
batch sizes and padding, the staged step inputs and the pinned buffer pool."""

import pytest
import torch

from fairbatch.engine import LLM, SamplingParams
from fairbatch.engine.attention import AttentionMetadata, FlashAttentionBackend
from fairbatch.engine.cuda_graphs import (
    graph_batch_sizes,
    input_shapes,
    pad_decode_rows,
    padded_batch_size,
)
from fairbatch.engine.gpu_profiles import H100_SXM, H200, profile_for_device
from fairbatch.engine.llm import build_engine
from fairbatch.engine.memory import (
    MemoryProfile,
    dummy_step,
    kv_cache_budget,
    max_useful_blocks,
    num_kv_blocks,
    run_dummy_step,
)
from fairbatch.engine.staging import Staging
from fairbatch.engine.tiny import build_tiny
from fairbatch.kv.cache_engine import CacheEngine, KVLayout, PinnedPool

GB = 1 << 30


def test_budget_subtracts_weights_activations_and_other_processes():
    p = MemoryProfile(total=80 * GB, weights=16 * GB, peak_activations=2 * GB, others=3 * GB)
    assert kv_cache_budget(p, 0.9) == int(80 * GB * 0.9) - 21 * GB
    # nothing left: zero, never negative
    assert kv_cache_budget(MemoryProfile(10 * GB, 9 * GB, 1 * GB, 1 * GB), 0.9) == 0
    with pytest.raises(ValueError):
        kv_cache_budget(p, 1.5)


def test_budget_sets_aside_the_cuda_graphs():
    eager = MemoryProfile(total=80 * GB, weights=16 * GB, peak_activations=2 * GB, others=3 * GB)
    assert eager.cuda_graphs == 0  # enforce_eager: nothing set aside
    graphs = MemoryProfile(80 * GB, 16 * GB, 2 * GB, 3 * GB, cuda_graphs=GB // 2)
    assert kv_cache_budget(graphs, 0.9) == int(80 * GB * 0.9) - 21 * GB - GB // 2
    assert kv_cache_budget(graphs, 0.9) == kv_cache_budget(eager, 0.9) - GB // 2
    # 64 KiB blocks: half a GiB of graphs is exactly 8192 blocks fewer
    assert num_kv_blocks(kv_cache_budget(eager, 0.9), 64 << 10) - num_kv_blocks(
        kv_cache_budget(graphs, 0.9), 64 << 10
    ) == (GB // 2) // (64 << 10)


def test_block_count_is_capped_by_what_the_sequences_can_fill():
    assert max_useful_blocks(max_model_len=2048, max_num_seqs=128, block_size=16) == 128 * 128
    assert max_useful_blocks(max_model_len=17, max_num_seqs=2, block_size=16) == 4  # rounds up
    # a tiny model on a 141 GB GPU: the budget would allow millions of blocks
    assert num_kv_blocks(130 * GB, 64 << 10, cap=16384) == 16384
    assert num_kv_blocks(10 * (64 << 10) + 5, 64 << 10, cap=16384) == 10
    assert num_kv_blocks(-1, 64 << 10) == 0


def test_dummy_step_is_the_largest_step():
    lens, tables = dummy_step(
        max_num_batched_tokens=100, max_num_seqs=8, max_model_len=40, block_size=16
    )
    assert lens == [40, 40, 20]
    assert tables == [[0, 1, 2], [3, 4, 5], [6, 7]]
    lens, _ = dummy_step(
        max_num_batched_tokens=100, max_num_seqs=2, max_model_len=40, block_size=16
    )
    assert lens == [40, 40]  # at most max_num_seqs sequences


def test_dummy_step_runs_on_the_tiny_model():
    model, config, _ = build_tiny("cpu")
    layout = KVLayout(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, 16,
                      torch.float32, head_major=True)  # fmt: skip
    lens, tables = dummy_step(64, 4, 48, 16)
    cache = CacheEngine(layout, sum(len(t) for t in tables), 0)
    from fairbatch.engine.sampler import Sampler

    run_dummy_step(model, cache.layer_caches(), lens, tables, 16, 4, Sampler())


def test_auto_sizing_on_cpu_is_capped():
    engine = build_engine("tiny", kv_cache_bytes=1 << 40, max_num_seqs=2, max_model_len=64)
    assert engine.scheduler.kv.gpu_pool.num_blocks == max_useful_blocks(64, 2, 16)


def test_settings_the_backend_cannot_run_fail_at_build_time():
    with pytest.raises(ValueError, match="cannot run here"):
        build_engine("tiny", attn_backend="flash")  # no CUDA here
    with pytest.raises(ValueError, match=">= 1"):
        build_engine("tiny", block_size=0)


def test_flash_block_size_check_names_the_backend(monkeypatch):
    from fairbatch.engine.models import CausalLM

    class Flashy(FlashAttentionBackend):
        def __init__(self):  # no kernel needed to check settings
            pass

    monkeypatch.setattr(CausalLM, "attn_backend", lambda self, dev, dtype: Flashy())
    with pytest.raises(ValueError, match="multiple of 16.*'flash'"):
        build_engine("tiny", block_size=8)


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(3) == [1, 2, 4]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 24]
    sizes = graph_batch_sizes(128)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 128 and len(sizes) == 19
    assert padded_batch_size(5, sizes) == 8
    assert padded_batch_size(17, sizes) == 24
    assert padded_batch_size(128, sizes) == 128
    assert padded_batch_size(129, sizes) is None
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


def test_padding_rows_are_one_token_sequences_in_the_pad_block():
    ids, lens, tables = pad_decode_rows([5, 6], [10, 3], [[1], [2]], 4, pad_block=9)
    assert ids == [5, 6, 0, 0] and lens == [10, 3, 1, 1] and tables == [[1], [2], [9], [9]]
    host = AttentionMetadata.host_inputs([1] * 4, lens, tables, 16, width=3)
    assert host["slot_mapping"].tolist() == [1 * 16 + 9, 2 * 16 + 2, 9 * 16, 9 * 16]
    assert host["block_tables"].shape == (4, 3)
    shapes = input_shapes(4, 3)
    assert shapes[3] == (5,) and shapes[5] == (4, 3)


def test_staging_packs_one_buffer_in_order():
    st = Staging("cpu")
    a, b = torch.tensor([1, 2, 3]), torch.tensor([[4, 5], [6, 7]], dtype=torch.int32)
    va, vb = st.upload([a, b])
    assert va.tolist() == [1, 2, 3] and vb.tolist() == [[4, 5], [6, 7]]
    assert vb.data_ptr() == va.data_ptr() + 3 * 4  # one flat int32 buffer
    out = torch.zeros(16, dtype=torch.int32)
    (vc,) = st.upload([torch.tensor([9, 8])], out=out)
    assert vc.data_ptr() == out.data_ptr() and out[:2].tolist() == [9, 8]


def test_staged_runner_matches_the_plain_cpu_path():
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=1)
    prompts = [f"prompt {i} " * (1 + i % 4) for i in range(6)]
    ref = LLM("tiny", num_gpu_blocks=256).generate(prompts, params)
    llm = LLM("tiny", num_gpu_blocks=256)
    runner = llm.engine.runner
    from fairbatch.engine.staging import Staging as _Staging

    runner.staging = _Staging("cpu")
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert [o.prompt_logprobs for o in got] == [o.prompt_logprobs for o in ref]


def test_pinned_pool_reuses_buffers():
    pool = PinnedPool(torch.float32, pin=False, keep=2)
    a = pool.take(100)
    pool.give(a)
    assert pool.take(50) is a  # big enough and free
    pool.give(a)
    b = pool.take(200)  # too small: a new one
    assert b is not a and pool.num_allocated == 2
    pool.give(b)
    pool.give(pool.take(10))
    pool.give(torch.empty(5))
    assert len(pool._idle) == 2  # the smallest idle one was dropped


def test_cache_engine_pad_block_is_past_the_pool():
    layout = KVLayout(2, 2, 4, 16, torch.float32)
    ce = CacheEngine(layout, 5, 1, pad_block=True)
    assert ce.pad_block == 5 and ce.gpu_cache.shape[2] == 6
    assert CacheEngine(layout, 5, 1).pad_block is None


def test_profile_for_device_names():
    assert profile_for_device("NVIDIA H200") is H200
    assert profile_for_device("NVIDIA H100 80GB HBM3") is H100_SXM
    assert profile_for_device("NVIDIA A100-SXM4-80GB").name == "A100-80GB"
    assert profile_for_device("NVIDIA GeForce RTX 4090") is None


def test_staged_decode_inputs_land_in_the_graph_views():
    from fairbatch.engine.cuda_graphs import INPUT_NAMES, DecodeGraphs

    kv = [torch.zeros(2, 11, 16, 2, 4)]
    g = DecodeGraphs(None, kv, block_size=16, max_num_seqs=5, max_model_len=64, pad_block=10)
    assert g.sizes == [1, 2, 4, 8] and g.width == 4
    ids, lens, tables = pad_decode_rows([3, 4, 5], [20, 2, 33], [[1, 2], [3], [4, 5, 6]], 4, 10)
    host = AttentionMetadata.host_inputs([1] * 4, lens, tables, 16, g.width)
    host["ids"] = torch.tensor(ids)
    views = Staging("cpu").upload([host[k] for k in INPUT_NAMES], out=g.static)
    expected = g.views(4)
    for name, view in zip(INPUT_NAMES, views):
        assert view.data_ptr() == expected[name].data_ptr() and view.shape == expected[name].shape
        assert torch.equal(expected[name], host[name].int())
    g._fill_padding(2)  # capture's inputs: padding rows only
    assert g.views(2)["slot_mapping"].tolist() == [160, 160]
    assert g.views(2)["query_start_loc"].tolist() == [0, 1, 2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit")
def test_gpu_check_fails_fast_without_cuda(tmp_path):
    import subprocess
    from pathlib import Path

    from fairbatch.benchmarks import gpu_check

    assert gpu_check.main(["--out", str(tmp_path / "r.json")]) == 2
    assert not (tmp_path / "r.json").exists()
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    assert gpu_check.llama_1b_config().num_hidden_layers == 16
