"""The prefix cache's host tier changes where K/V comes from, never the tokens.

Conversations in waves (each turn's prompt is the last one plus a new user turn) on a device
pool far smaller than their histories, so that earlier turns' blocks are evicted to the host
tier and loaded back. Every slicing (plain, chunked prefill, swap, recompute), LoRA adapters
and n > 1 seeded samples give exactly the tokens of the same run without the tier, and the
plain greedy ones those of transformers.
"""

import random

import pytest
import torch
from lora_adapters import make_tiny_adapter

from fairbatch.engine import LLM, SamplingParams
from fairbatch.engine.sampling_params import LoRARequest

NEW_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
TIER = dict(num_cpu_cache_blocks=256)


def conversation_waves(n=4, turns=3, vocab=512, seed=0) -> list[list[list[int]]]:
    """`turns` waves of `n` prompts: conversation i's history after each turn."""
    rng = random.Random(seed)
    histories = [[rng.randrange(3, vocab) for _ in range(20)] for _ in range(n)]
    waves = []
    for _ in range(turns):
        for h in histories:
            h.extend(rng.randrange(3, vocab) for _ in range(rng.randint(6, 18)))
        waves.append([list(h) for h in histories])
    return waves


def hf_greedy(path, prompts):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs


def run_waves(model, waves, params=GREEDY, lora=None, **kwargs):
    """Each sample's tokens, wave after wave on one engine, and the LLM."""
    llm = LLM(model, block_size=4, **kwargs)
    tokens = []
    for wave in waves:
        for o in llm.generate(wave, params, use_tqdm=False, lora=lora):
            tokens.append([s.token_ids for s in o.samples])
        llm.engine.check_integrity()
    assert llm.engine.scheduler.kv.all_free()
    return tokens, llm


@pytest.fixture(scope="module")
def waves():
    return conversation_waves()


@pytest.fixture(scope="module")
def hf_ref(llama_ckpt, waves):
    return [[t] for t in hf_greedy(llama_ckpt, [p for wave in waves for p in wave])]


SLICINGS = {
    "plain": dict(num_gpu_blocks=40),
    "chunked": dict(num_gpu_blocks=40, max_num_batched_tokens=7),
    "swap": dict(num_gpu_blocks=28, num_cpu_blocks=64, preemption_mode="swap"),
    "recompute": dict(num_gpu_blocks=28, preemption_mode="recompute"),
}


@pytest.mark.parametrize("slicing", list(SLICINGS))
def test_the_tier_changes_no_token(llama_ckpt, waves, hf_ref, slicing):
    kwargs = SLICINGS[slicing]
    plain, llm0 = run_waves(str(llama_ckpt), waves, **kwargs)
    tiered, llm1 = run_waves(str(llama_ckpt), waves, **kwargs, **TIER)
    assert tiered == plain == hf_ref
    s0, s1 = llm0.engine.scheduler, llm1.engine.scheduler
    assert s1.num_host_hit_tokens > 0 and s0.num_host_hit_tokens == 0
    assert s1.num_prefix_hit_tokens > s0.num_prefix_hit_tokens
    assert llm1.engine.runner.cache.bytes_host_tier["load"] > 0
    if slicing in ("swap", "recompute"):
        assert s1.num_preemptions[slicing] > 0


def test_seeded_samples_with_n_2_are_the_same_with_the_tier(waves):
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=NEW_TOKENS, ignore_eos=True)
    plain, _ = run_waves("tiny", waves, params, num_gpu_blocks=40)
    tiered, llm = run_waves("tiny", waves, params, num_gpu_blocks=40, **TIER)
    assert tiered == plain
    assert all(len(samples) == 2 for samples in tiered)
    assert llm.engine.scheduler.num_host_hit_tokens > 0


def test_lora_requests_are_the_same_with_the_tier_and_salted_apart(waves, tmp_path):
    lora = LoRARequest("a", make_tiny_adapter(tmp_path / "a", seed=3))
    kwargs = dict(num_gpu_blocks=40, max_loras=1, max_lora_rank=8)
    plain, _ = run_waves("tiny", waves, lora=lora, **kwargs)
    tiered, llm = run_waves("tiny", waves, lora=lora, **kwargs, **TIER)
    assert tiered == plain
    scheduler = llm.engine.scheduler
    assert scheduler.num_host_hit_tokens > 0
    # the base model finds none of the adapter's blocks, in either tier
    prompt = waves[-1][0]
    assert _cached_blocks(llm, prompt, lora) == len(prompt) // 4
    assert _cached_blocks(llm, prompt, None) == 0
    out = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert out[0].num_cached_tokens == 0


def _cached_blocks(llm, prompt, lora) -> int:
    """Blocks of `prompt` (under `lora`) that the device and host tiers hold, in prefix order."""
    kv = llm.engine.scheduler.kv
    probe = llm.engine.make_request(prompt + [3], GREEDY, lora=lora)
    device, _ = kv.get_computed_blocks(probe)
    host = kv.get_host_blocks(probe, len(device))
    kv.forget(probe)
    return len(device) + len(host)


def test_the_tier_reaches_the_metrics(waves):
    from fairbatch.deployments.api.prometheus import engine_families

    _, llm = run_waves("tiny", waves, num_gpu_blocks=40, **TIER)
    stats = llm.engine.stats()["host_tier"]
    kv = llm.engine.scheduler.kv
    assert stats["hit_tokens"] == llm.engine.scheduler.num_host_hit_tokens > 0
    assert stats["loaded_blocks"] == kv.num_loaded_blocks == stats["hit_tokens"] // 4
    assert stats["cached_blocks"] == len(kv.cpu_pool.cached) > 0
    assert stats["capacity_blocks"] == kv.num_cpu_blocks  # swap space + tier: one pool
    shown = {}
    for family in engine_families(llm.engine.stats()):
        for sample in family.samples:
            shown[(sample.name, tuple(sample.labels.items()))] = sample.value
    assert shown[("fairbatch_host_tier_hit_tokens_total", ())] == stats["hit_tokens"]
    assert shown[("fairbatch_host_tier_cached_blocks", ())] == stats["cached_blocks"]
    for event in ("stored", "loaded", "evicted"):
        key = ("fairbatch_host_tier_block_events_total", (("event", event),))
        assert shown[key] == stats[f"{event}_blocks"]
