"""CUDA swap path: pinned host memory, the copy stream and events. Skipped without CUDA."""

import pytest
import torch

from fairbatch.kv.cache_engine import CacheEngine, KVLayout

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_swap_round_trip_on_cuda(dtype):
    layout = KVLayout(num_layers=3, num_kv_heads=4, head_dim=64, block_size=16, dtype=dtype)
    ce = CacheEngine(layout, 32, 16, "cuda")
    assert ce.cpu_cache.is_pinned()
    ce.gpu_cache.normal_()
    before = ce.gpu_cache.clone()
    ce.swap_out([(3, 0), (7, 5), (31, 9)])
    # The freed blocks are overwritten by the next "forward" on the compute stream: the swap
    # stream's gather must have read them first (the compute stream waits on its event).
    ce.gpu_cache[:, :, [3, 7, 31]] = 0
    ce.swap_in([(5, 1), (9, 2), (0, 3)])
    torch.cuda.synchronize()
    assert torch.equal(ce.gpu_cache[:, :, 1], before[:, :, 7])
    assert torch.equal(ce.gpu_cache[:, :, 2], before[:, :, 31])
    assert torch.equal(ce.gpu_cache[:, :, 3], before[:, :, 3])
    data = ce.export_blocks([0, 5])
    assert data.shape == (3, 2, 2, 16, 4, 64)


@cuda
def test_host_tier_store_and_load_on_cuda():
    """A store's copy lands before a load reads the block; a load is waited for by the next
    step's compute stream (`wait_loads`), not the step that issued it."""
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16)
    ce = CacheEngine(layout, 16, 8, "cuda")
    ce.gpu_cache.normal_()
    before = ce.gpu_cache.clone()
    ce.store([(4, 0), (9, 1)])
    ce.gpu_cache[:, :, [4, 9]] = 0  # the evicted blocks reused by the step's forward
    ce.load([(1, 2), (0, 3)])  # a later step's hit on the stored blocks
    ce.wait_loads()
    ce.gpu_cache[:, :, 5] = ce.gpu_cache[:, :, 2] + 1  # the next step reads a loaded block
    torch.cuda.synchronize()
    assert torch.equal(ce.gpu_cache[:, :, 2], before[:, :, 9])
    assert torch.equal(ce.gpu_cache[:, :, 3], before[:, :, 4])
    assert torch.equal(ce.gpu_cache[:, :, 5], before[:, :, 9] + 1)
    assert ce.bytes_host_tier == {
        "store": 2 * layout.bytes_per_block,
        "load": 2 * layout.bytes_per_block,
    }


# Greedy outputs under preemption are compared with an unpreempted run by their logprobs, not
# bit for bit: a preempted run computes the same sequences in other batch compositions, and
# neither cuBLAS nor flash attention promises the same bf16 rounding across batch shapes (the
# tiny model's bf16 logits even tie exactly now and then). What a correct swap or recompute
# does promise is the same model up to that rounding:
#   * while the tokens agree, each one's logprob agrees within LP_TOL (a few bf16 ulps of the
#     logits; measured in bf16 on CPU, this test's runs: under 0.07), and
#   * where they first differ, both runs saw a near-tie: each one's token is in the other's
#     top-TOP_N, and each token is within 2 x LP_TOL of the other in both runs (a flip needs
#     the two logprobs to cross, so each gap is at most the noise of the two runs added up).
# After a legitimate flip the contexts differ, so that request is not compared further. A swap
# that brings back wrong K/V fails this (tried in bf16 on CPU: zeroing one swapped-in block, or
# only its last slot, or adding noise of std 0.05 to it, each fails the check).
LP_TOL = 0.25
TOP_N = 5


def _top(entry: list[tuple[int, float]]) -> dict[int, float]:
    return dict(entry[1:])  # entry: [(sampled, lp), (top1, lp), ...]


def assert_same_model_output(got, ref, what: str) -> None:
    """Raises unless each of `got` is `ref` up to bf16 rounding (see above)."""
    for a, b in zip(got, ref, strict=True):
        assert len(a.token_ids) == len(b.token_ids) == len(a.logprobs) == len(b.logprobs)
        for i, (ea, eb) in enumerate(zip(a.logprobs, b.logprobs)):
            (ta, lpa), (tb, lpb) = ea[0], eb[0]
            where = f"{what}, {b.request_id} token {i}"
            if ta == tb:
                assert abs(lpa - lpb) <= LP_TOL, f"{where}: logprob {lpa} vs {lpb}"
                continue
            top_a, top_b = _top(ea), _top(eb)
            assert tb in top_a and ta in top_b, f"{where}: {ta} vs {tb}, not in each other's top"
            assert lpb - top_b[ta] <= 2 * LP_TOL, f"{where}: {ta} is no near-tie in the reference"
            assert lpa - top_a[tb] <= 2 * LP_TOL, f"{where}: {tb} is no near-tie in this run"
            break  # contexts differ from here on


@cuda
def test_engine_generate_on_cuda_matches_with_swap_and_recompute():
    from fairbatch.engine import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=TOP_N)
    prompts = [f"request {i} on the gpu path" * (1 + i % 3) for i in range(12)]
    ref = LLM("tiny", device="cuda", num_gpu_blocks=512).generate(prompts, params)
    for mode in ("swap", "recompute"):
        llm = LLM(
            "tiny", device="cuda", num_gpu_blocks=10, num_cpu_blocks=256, preemption_mode=mode
        )
        got = llm.generate(prompts, params)
        assert llm.engine.scheduler.num_preemptions[mode] > 0
        if mode == "swap":
            assert llm.engine.runner.cache.bytes_swapped["in"] > 0
        assert_same_model_output(got, ref, mode)
        llm.engine.check_integrity()
        assert llm.engine.scheduler.kv.all_free()
