"""fairbatch's greedy tokens equal transformers' `generate`, however the work is sliced.

One reference per prompt from HF (batch of one, no padding), then fairbatch runs the whole batch
plainly, with chunked prefills, under swap preemption, under recompute preemption, and with
shared prefixes hitting the prefix cache.
"""

import dataclasses
import json
import random
import shutil

import pytest
import torch

from fairbatch.engine import LLM, SamplingParams

NEW_TOKENS = 12


def make_prompts(n=16, vocab=512, shared_prefix=0, seed=0):
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(3, vocab) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def hf_greedy(path, prompts, new_tokens=NEW_TOKENS):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # compare full lengths; EOS is tested apart
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def fb_greedy(path, prompts, **kwargs):
    llm = LLM(str(path), **kwargs)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    engine = llm.engine
    engine.check_integrity()
    assert engine.scheduler.kv.all_free()
    return [o.token_ids for o in outs], engine


@pytest.fixture(scope="module")
def prompts():
    return make_prompts()


@pytest.fixture(scope="module")
def llama_ref(llama_ckpt, prompts):
    return hf_greedy(llama_ckpt, prompts)


def test_plain_batch_matches_hf(llama_ckpt, prompts, llama_ref):
    got, _ = fb_greedy(llama_ckpt, prompts, block_size=4, num_gpu_blocks=512)
    assert got == llama_ref


def test_chunked_prefill_matches_hf(llama_ckpt, prompts, llama_ref):
    got, engine = fb_greedy(
        llama_ckpt, prompts, block_size=4, num_gpu_blocks=512, max_num_batched_tokens=7
    )
    assert got == llama_ref


def test_swap_preemption_matches_hf(llama_ckpt, prompts, llama_ref):
    got, engine = fb_greedy(
        llama_ckpt,
        prompts,
        block_size=4,
        num_gpu_blocks=40,
        num_cpu_blocks=400,
        preemption_mode="swap",
    )
    assert engine.scheduler.num_preemptions["swap"] > 0
    assert engine.runner.cache.bytes_swapped["in"] > 0
    assert got == llama_ref


def test_recompute_preemption_matches_hf(llama_ckpt, prompts, llama_ref):
    got, engine = fb_greedy(
        llama_ckpt, prompts, block_size=4, num_gpu_blocks=40, preemption_mode="recompute"
    )
    assert engine.scheduler.num_preemptions["recompute"] > 0
    assert got == llama_ref


def test_prefix_cache_hits_match_hf(llama_ckpt):
    shared = make_prompts(n=16, shared_prefix=24, seed=1)
    ref = hf_greedy(llama_ckpt, shared)
    got, engine = fb_greedy(
        llama_ckpt, shared, block_size=4, num_gpu_blocks=512, max_num_batched_tokens=48
    )
    assert engine.scheduler.num_prefix_hit_tokens >= 24 * 8  # most requests reused the prefix
    assert got == ref


@pytest.mark.parametrize("ckpt", ["qwen2_ckpt", "llama3_ckpt", "mistral_ckpt"])
def test_other_architectures_match_hf(request, ckpt, prompts):
    path = request.getfixturevalue(ckpt)
    ref = hf_greedy(path, prompts[:8])
    got, _ = fb_greedy(
        path, prompts[:8], block_size=4, num_gpu_blocks=60, max_num_batched_tokens=16
    )
    assert got == ref


def test_eos_stops_generation(llama_ckpt, tmp_path):
    """Generation stops at the checkpoint's EOS (its generation_config, a list of ids): the
    output is the undisturbed greedy output up to and including the first EOS, finish_reason
    "stop"; ignore_eos runs past it. The EOS id is picked from the undisturbed output, so the
    model really emits it (nothing is asked for through stop_token_ids)."""
    prompt = [7, 8, 9]
    free_params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    free = LLM(str(llama_ckpt), block_size=4, num_gpu_blocks=64).generate([prompt], free_params)
    tokens = free[0].token_ids
    assert len(tokens) == 20
    # The first token that is new at position >= 3: EOS must stop a request that has already
    # generated tokens, and nothing before it may be an EOS.
    cut = next((i for i, t in enumerate(tokens) if i >= 3 and t not in tokens[:i]), None)
    assert cut is not None, f"the greedy output repeats itself from the start: {tokens}"
    eos = tokens[cut]
    never = next(t for t in range(3, 512) if t not in tokens)  # a second id, never emitted
    ckpt = tmp_path / "llama_eos"
    shutil.copytree(llama_ckpt, ckpt)
    gen_file = ckpt / "generation_config.json"
    gen_file.write_text(
        json.dumps({**json.loads(gen_file.read_text()), "eos_token_id": [never, eos]})
    )

    llm = LLM(str(ckpt), block_size=4, num_gpu_blocks=64)
    assert llm.engine.eos_token_ids == (never, eos)  # read from the generation config
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20))[0]
    assert out.token_ids == tokens[: cut + 1]  # ends exactly at the first EOS, kept in the ids
    assert out.finish_reason == "stop"
    past = llm.generate([prompt], free_params)[0]
    assert past.token_ids == tokens and past.finish_reason == "length"
    assert llm.engine.scheduler.kv.all_free()


def test_the_token_that_stops_a_request_is_not_in_its_text():
    """A stop token id (or EOS) ends the request and stays in its token ids, but not in its
    text, as a stop string is not (vLLM's convention): even when special tokens are kept in the
    text. `include_stop_str_in_output` keeps it. The reference text is the tokenizer's decode."""
    llm = LLM("tiny", num_gpu_blocks=256)
    tok = llm.engine.tokenizer
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ids = llm.generate(["fair batching"], free)[0].token_ids
    cut = next(i for i, t in enumerate(ids) if i >= 3 and t not in ids[:i])
    stop = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[ids[cut]])
    out = llm.generate(["fair batching"], stop)[0]
    assert out.token_ids == ids[: cut + 1] and out.finish_reason == "stop"
    assert out.text == tok.decode(ids[:cut])
    kept = dataclasses.replace(stop, include_stop_str_in_output=True)
    assert llm.generate(["fair batching"], kept)[0].text == tok.decode(ids[: cut + 1])
    # EOS with special tokens kept in the text: the EOS itself is not
    eos = min(llm.engine.eos_token_ids)
    raw = SamplingParams(temperature=0, max_tokens=12, skip_special_tokens=False)
    ends = llm.generate(["fair batching"], dataclasses.replace(raw, logit_bias={eos: 100.0}))[0]
    assert ends.token_ids == [eos] and ends.text == "" and ends.finish_reason == "stop"
    assert tok.decode([eos], skip_special_tokens=False)  # (it has a text of its own)


def test_seeded_sampling_is_reproducible_and_batch_independent():
    llm = LLM("tiny", num_gpu_blocks=256)
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=16, ignore_eos=True)
    alone = llm.generate(["the scheduler"], p, use_tqdm=False)[0].token_ids
    others = SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True)
    mixed = llm.generate(
        ["a b c", "the scheduler", "tenants share gpus"], [others, p, others], use_tqdm=False
    )
    assert mixed[1].token_ids == alone
    again = LLM("tiny", num_gpu_blocks=256).generate(["the scheduler"], p, use_tqdm=False)
    assert again[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=43, max_tokens=16, ignore_eos=True)
    assert llm.generate(["the scheduler"], other_seed)[0].token_ids != alone


def test_seeded_sampling_survives_preemption():
    p = SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)
    prompts = [f"request number {i} about fair batching" for i in range(8)]
    ref = [o.token_ids for o in LLM("tiny", num_gpu_blocks=512).generate(prompts, p)]
    tight = LLM("tiny", num_gpu_blocks=12, block_size=16, preemption_mode="recompute")
    got = [o.token_ids for o in tight.generate(prompts, p)]
    assert tight.engine.scheduler.num_preemptions["recompute"] > 0
    assert got == ref


def test_text_and_stop_strings():
    llm = LLM("tiny", num_gpu_blocks=128)
    full = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    text = full[0].text
    assert text == llm.tokenizer.decode(full[0].token_ids)
    stop = text[5:8]
    assert stop and stop.strip()
    cut = llm.generate(
        ["hello"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop])
    )[0]
    assert cut.finish_reason == "stop"
    assert cut.text == text[: text.index(stop)]
    assert llm.engine.scheduler.kv.all_free()


def test_bad_requests_raise_clear_errors():
    llm = LLM("tiny", num_gpu_blocks=8, block_size=16)  # 128-token context
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="limit"):
        llm.generate([[5] * 200], GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[10**6]], GREEDY)
    assert not llm.engine.has_unfinished()


def test_a_prompt_that_is_not_token_ids_is_refused_by_name():
    # a float or None is no token id (before: 1.5 was read as token 1, None a TypeError);
    # numpy's integers are ids
    import numpy as np

    llm = LLM("tiny", num_gpu_blocks=64)
    for bad in ([1.5], None, [3, None], ["a", "b"]):
        with pytest.raises(ValueError, match="list of token ids"):
            llm.generate([bad], SamplingParams(max_tokens=1), use_tqdm=False)
    out = llm.generate([np.array([5, 6, 7])], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].token_ids) == 2
    assert llm.engine.scheduler.num_waiting == 0 and not llm.engine.has_unfinished()
