"""Prompt log-probs (`SamplingParams(prompt_logprobs=k)`) equal transformers' `log_softmax` on
the same checkpoint, position by position, however the prompt was computed: in one piece, in
chunks, after a prefix-cache hit was possible (the cache is bypassed for such requests: cached
blocks never produced the logits), under swap and recompute preemption. Also: the exact count
of prompt tokens served from the prefix cache, and logit_bias."""

import random

import pytest
import torch

from fairbatch.engine import LLM, SamplingParams

TOP = 3
TOL = 1e-4


def make_prompts(n, lo=5, hi=30, seed=0, prefix=()):
    rng = random.Random(seed)
    return [list(prefix) + [rng.randrange(3, 512) for _ in range(rng.randint(lo, hi))]
            for _ in range(n)]  # fmt: skip


def hf_prompt_logprobs(path, prompts):
    """Per prompt: [None, (lp of token 1, top ids, top lps), ...] from transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    refs = []
    with torch.no_grad():
        for p in prompts:
            lp = model(torch.tensor([p])).logits[0].float().log_softmax(-1)
            ref = [None]
            for i in range(1, len(p)):
                vals, ids = lp[i - 1].topk(TOP)
                ref.append((lp[i - 1, p[i]].item(), ids.tolist(), vals.tolist()))
            refs.append(ref)
    return refs


def assert_matches(got, ref, prompt):
    assert len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        entry = got[i]
        lp, top_ids, top_vals = ref[i]
        assert entry[0][0] == prompt[i]  # the prompt token's own record comes first
        assert abs(entry[0][1] - lp) <= TOL, (i, entry[0][1], lp)
        assert [t for t, _ in entry[1:]] == top_ids
        assert all(abs(v - r) <= TOL for (_, v), r in zip(entry[1:], top_vals))


PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=TOP)


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(10)


@pytest.fixture(scope="module")
def refs(llama_ckpt, prompts):
    return hf_prompt_logprobs(llama_ckpt, prompts)


def run(path, prompts, params=PARAMS, **kw):
    llm = LLM(str(path), block_size=4, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.engine.check_integrity()
    assert llm.engine.scheduler.kv.all_free()
    return outs, llm


@pytest.mark.parametrize(
    "kw",
    [
        {"num_gpu_blocks": 512},
        {"num_gpu_blocks": 512, "max_num_batched_tokens": 7},  # chunked prefill
    ],
    ids=["whole", "chunked"],
)
def test_prompt_logprobs_match_hf(llama_ckpt, prompts, refs, kw):
    outs, _ = run(llama_ckpt, prompts, **kw)
    for o, ref, p in zip(outs, refs, prompts):
        assert_matches(o.prompt_logprobs, ref, p)
        assert o.logprobs is None and len(o.token_ids) == 3  # generation is unaffected


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_prompt_logprobs_survive_preemption(llama_ckpt, prompts, refs, mode):
    long = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, prompt_logprobs=TOP)
    outs, llm = run(
        llama_ckpt, prompts, long, num_gpu_blocks=20, num_cpu_blocks=200, preemption_mode=mode
    )
    assert llm.engine.scheduler.num_preemptions[mode] > 0
    for o, ref, p in zip(outs, refs, prompts):
        assert_matches(o.prompt_logprobs, ref, p)


def test_a_repeated_prompt_is_scored_again_and_its_cache_hits_are_counted(llama_ckpt, refs):
    prompt = make_prompts(1, lo=21, hi=21, seed=7)[0]  # 21 tokens: 5 full blocks of 4
    ref = hf_prompt_logprobs(llama_ckpt, [prompt])[0]
    llm = LLM(str(llama_ckpt), block_size=4, num_gpu_blocks=512)
    plain = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    first = llm.generate([prompt], PARAMS, use_tqdm=False)[0]
    again = llm.generate([prompt], PARAMS, use_tqdm=False)[0]
    hit = llm.generate([prompt], plain, use_tqdm=False)[0]
    assert_matches(first.prompt_logprobs, ref, prompt)
    assert_matches(again.prompt_logprobs, ref, prompt)  # the cache was bypassed, not read
    assert first.num_cached_tokens == again.num_cached_tokens == 0
    # At least one token is always computed: 20 of 21 can be cached, in whole blocks: 20.
    assert hit.num_cached_tokens == 20 and hit.prompt_logprobs is None
    assert llm.engine.scheduler.num_prefix_hit_tokens == 20


def test_logit_bias_forces_and_bans_tokens(llama_ckpt):
    llm = LLM(str(llama_ckpt), block_size=4, num_gpu_blocks=256)
    prompt = make_prompts(1, seed=3)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    base = llm.generate([prompt], greedy, use_tqdm=False)[0].token_ids
    forced = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={300: 100})
    assert llm.generate([prompt], forced, use_tqdm=False)[0].token_ids == [300] * 6 != base
    # a huge value is clamped to OpenAI's 100 (still forcing); -100 bans the greedy choice
    big = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={300: 1e9})
    assert big.logit_bias == {300: 100.0}
    banned = SamplingParams(
        temperature=0.0, max_tokens=1, ignore_eos=True, logit_bias={base[0]: -100}
    )
    assert llm.generate([prompt], banned, use_tqdm=False)[0].token_ids[0] != base[0]
    # sampled rows too: with the bias, temperature 1 still picks the forced token
    hot = SamplingParams(temperature=1.0, seed=1, max_tokens=4, logit_bias={300: 100})
    assert llm.generate([prompt], hot, use_tqdm=False)[0].token_ids == [300] * 4
    vocab = llm.engine.vocab_size
    with pytest.raises(ValueError, match="logit_bias token ids must be in"):
        llm.generate([prompt], SamplingParams(logit_bias={vocab: 5}), use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias keys"):
        SamplingParams(logit_bias={-1: 5})
