"""SamplingParams(n > 1) on the real model: one prefill, the siblings on the prompt's blocks.

Each sample must equal a lone request with its parameters (`params.for_sample(i)`): greedy
samples the n = 1 output, seeded ones a run with the derived seed, whatever the batch, and
also when a sibling is swapped out or dropped for recompute.
"""

import pytest

from fairbatch.engine import LLM, SamplingParams
from fairbatch.engine.sampling_params import MAX_N, sample_seed

PROMPT = [1, 17, 33, 49, 65, 81, 97, 113, 129, 145]  # 10 tokens: position 9 is mid-block (4)
OTHER = [1, 200, 201, 202, 203, 204, 205]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)


def make_llm(path, **kwargs) -> LLM:
    kwargs.setdefault("block_size", 4)
    kwargs.setdefault("num_gpu_blocks", 256)
    return LLM(str(path), **kwargs)


def count_prompt_tokens(engine) -> list[int]:
    """Wrap the runner: the prompt positions it computes, summed over all steps."""
    counted = [0]
    execute = engine.runner.execute

    def counting(out):
        for req in out.scheduled:
            start = req.num_computed_tokens
            end = min(start + out.num_scheduled_tokens[req.request_id], req.num_prompt_tokens)
            counted[0] += max(end - start, 0)
        return execute(out)

    engine.runner.execute = counting
    return counted


def samples(output) -> list[list[int]]:
    return [s.token_ids for s in output.samples]


def lone_runs(path, params: SamplingParams) -> list[list[int]]:
    """Each sample of `params` as a lone n = 1 request on a fresh engine (no forks)."""
    out = []
    for i in range(params.n):
        llm = make_llm(path)
        out.append(llm.generate([PROMPT], params.for_sample(i), use_tqdm=False)[0].token_ids)
        assert llm.engine.scheduler.num_forks == 0
    return out


def check_idle(engine) -> None:
    engine.check_integrity()
    assert engine.scheduler.kv.all_free()


def test_greedy_samples_equal_the_single_output_after_one_prefill(llama_ckpt):
    single = make_llm(llama_ckpt).generate([PROMPT], GREEDY, use_tqdm=False)[0]
    llm = make_llm(llama_ckpt)
    computed = count_prompt_tokens(llm.engine)
    (out,) = llm.generate([PROMPT], SamplingParams(**{**vars(GREEDY), "n": 3}), use_tqdm=False)
    assert samples(out) == [single.token_ids] * 3
    assert out.token_ids == single.token_ids and out.text == single.text
    assert [s.index for s in out.samples] == [0, 1, 2]
    assert computed[0] == len(PROMPT) + 2  # one prefill, then one token per sibling
    assert llm.engine.scheduler.num_forks == 2
    check_idle(llm.engine)


def test_seeded_samples_use_derived_seeds_whatever_the_batch(llama_ckpt):
    def lone(seed):
        p = SamplingParams(**{**vars(SEEDED), "seed": seed})
        return make_llm(llama_ckpt).generate([PROMPT], p, use_tqdm=False)[0].token_ids

    expected = [lone(sample_seed(SEEDED.seed, i)) for i in range(3)]
    assert expected[0] == lone(SEEDED.seed)  # sample 0 keeps the seed
    assert len({tuple(t) for t in expected}) == 3  # the derived seeds differ
    params = SamplingParams(**{**vars(SEEDED), "n": 3})
    llm = make_llm(llama_ckpt)
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    assert samples(out) == expected
    # again, in a batch with other prompts and other samplers: the same samples
    others = SamplingParams(temperature=0.7, max_tokens=5, n=2)
    mixed = make_llm(llama_ckpt).generate(
        [OTHER, PROMPT, OTHER], [others, params, GREEDY], use_tqdm=False
    )
    assert samples(mixed[1]) == expected
    assert len(mixed[0].samples) == 2 and len(mixed[2].samples) == 1
    check_idle(llm.engine)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("when", [0, 3])  # before the sibling's first step (copy pending), later
def test_a_preempted_sibling_produces_the_same_tokens(llama_ckpt, mode, when):
    params = SamplingParams(**{**vars(SEEDED), "n": 3})
    engine = make_llm(llama_ckpt).engine
    engine.add_request(PROMPT, params.for_sample(0), request_id="s0")
    for i in (1, 2):
        engine.add_request(PROMPT, params.for_sample(i), request_id=f"s{i}", fork_of="s0")
    got: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished():
        for d in engine.step():
            got.setdefault(d.request_id, []).extend(d.token_ids)
        steps += 1
        if steps == 1 + when:
            assert engine.preempt("s1", mode)
    assert engine.scheduler.num_preemptions[mode] == 1
    assert engine.scheduler.num_forks == 2
    assert [got["s0"], got["s1"], got["s2"]] == lone_runs(llama_ckpt, params)
    check_idle(engine)


def test_siblings_preempted_for_blocks_produce_the_same_tokens(llama_ckpt):
    params = SamplingParams(**{**vars(SEEDED), "n": 4, "max_tokens": 40})
    ref = lone_runs(llama_ckpt, params)
    for mode in ("swap", "recompute"):
        llm = make_llm(llama_ckpt, num_gpu_blocks=24, preemption_mode=mode)
        (out,) = llm.generate([PROMPT], params, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions[mode] > 0
        assert llm.engine.scheduler.num_forks == 3
        assert samples(out) == ref
        check_idle(llm.engine)


def test_prompt_logprobs_are_shared_by_the_siblings(llama_ckpt):
    p = SamplingParams(**{**vars(GREEDY), "prompt_logprobs": 2})
    single = make_llm(llama_ckpt).generate([PROMPT], p, use_tqdm=False)[0]
    llm = make_llm(llama_ckpt)
    computed = count_prompt_tokens(llm.engine)
    (out,) = llm.generate([PROMPT], SamplingParams(**{**vars(p), "n": 2}), use_tqdm=False)
    assert out.prompt_logprobs == single.prompt_logprobs
    assert samples(out) == [single.token_ids] * 2
    assert computed[0] == len(PROMPT) + 1


def test_n_is_bounded_and_one_engine_request_is_one_sample():
    with pytest.raises(ValueError, match="^n "):
        SamplingParams(n=MAX_N + 1)
    with pytest.raises(ValueError, match="^n "):
        SamplingParams(n=0)
    p = SamplingParams(n=3, seed=5)
    assert [q.seed for q in map(p.for_sample, range(3))] == [
        5,
        sample_seed(5, 1),
        sample_seed(5, 2),
    ]
    assert all(p.for_sample(i).n == 1 for i in range(3))
    assert SamplingParams(n=2).for_sample(1).seed is None
    llm = LLM("tiny", num_gpu_blocks=32)
    with pytest.raises(ValueError, match="for_sample"):
        llm.engine.add_request([1, 2, 3], p)
