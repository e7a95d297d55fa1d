"""What real clients (lm-eval, LangChain's completions LLM) need of /v1/completions, through the
official `openai` client over HTTP on a LocalBackend: prompt lists, echo with prompt log-probs
(and `max_tokens: 0`), logit_bias, usage.prompt_tokens_details.cached_tokens; references are the
engine's own `LLM.generate` outputs on the same tiny model, and transformers-checked engine
values (tests/engine/test_prompt_logprobs.py)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from loopback import ServerLoop

from fairbatch.deployments.api.backend import LocalBackend, create_app
from fairbatch.engine import LLM, SamplingParams
from fairbatch.engine.llm import build_engine

MODEL = "fairbatch-tiny"
KEY = "key-batch"
BLOCK = 16  # the engine's default block size


@pytest.fixture(scope="module")
def served():
    loop = ServerLoop()
    backend = LocalBackend(build_engine("tiny", num_gpu_blocks=256, max_num_seqs=16))
    config = {"tenants": [{"name": "t", "api_key": KEY}], "limits": {"max_prompts_per_request": 4}}
    app = create_app(backend, config)
    url = loop.serve(app)
    yield openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60), url, app
    loop.run(backend.shutdown())
    loop.close()


@pytest.fixture(scope="module")
def ref():
    return LLM("tiny")


def greedy(ref, prompt, n, **kw):
    params = SamplingParams(temperature=0.0, max_tokens=n, **kw)
    return ref.generate([prompt], params, use_tqdm=False)[0]


PROMPTS = ["The scheduler decides", "Paged attention keeps", "Tenants share", "A block"]


def test_a_list_of_prompts_gets_one_choice_per_prompt_in_order(served, ref):
    c, _, app = served
    before = app.state.registry.tenants["t"].requests_admitted
    out = c.completions.create(model=MODEL, prompt=PROMPTS[:3], max_tokens=6, temperature=0)
    assert [ch.index for ch in out.choices] == [0, 1, 2]
    for ch, p in zip(out.choices, PROMPTS):
        assert ch.text == greedy(ref, p, 6).text and ch.finish_reason == "length"
    # each prompt is its own engine request of the tenant, charged as such
    assert app.state.registry.tenants["t"].requests_admitted == before + 3
    tok = ref.tokenizer
    assert out.usage.prompt_tokens == sum(len(tok.encode(p)) for p in PROMPTS[:3])
    assert out.usage.completion_tokens == 18
    # token-id prompts, a batch of them
    ids = [tok.encode(p) for p in PROMPTS[:2]]
    by_ids = c.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert [ch.text for ch in by_ids.choices] == [ch.text for ch in out.choices[:2]]


def test_a_streamed_batch_interleaves_chunks_tagged_by_index(served, ref):
    c, _, _ = served
    stream = c.completions.create(
        model=MODEL, prompt=PROMPTS[:3], max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    texts, reasons, order = ["", "", ""], [None] * 3, []
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            texts[ch.index] += ch.text
            order.append(ch.index)
            reasons[ch.index] = ch.finish_reason or reasons[ch.index]
    assert texts == [greedy(ref, p, 8).text for p in PROMPTS[:3]]
    assert reasons == ["length"] * 3 and usage.completion_tokens == 24
    assert order != sorted(order)  # interleaved, not one prompt after the other


def test_more_prompts_than_the_limit_is_a_400_naming_it(served):
    _, url, _ = served
    body = {"model": MODEL, "prompt": ["a"] * 5, "max_tokens": 1}
    r = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and "max_prompts_per_request" in r.json()["error"]["message"]


def test_a_request_needing_more_slots_than_its_tenant_may_hold_is_a_400_not_a_429():
    # prompts x n requests go in flight at once; more than the tenant's bound could never be
    # admitted, so it is no 429 (which says: retry), even on an idle server
    from chat_fixtures import ScriptedReply

    loop = ServerLoop()
    config = {"tenants": [{"name": "t", "api_key": KEY, "max_requests": 4}]}
    url = loop.serve(create_app(ScriptedReply("ok"), config))
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        for path, body, param in [
            ("completions", {"prompt": ["a", "b"], "n": 3}, "n"),
            ("completions", {"prompt": ["a"] * 5}, "prompt"),
            ("chat/completions", {"messages": [{"role": "user", "content": "a"}], "n": 5}, "n"),
        ]:
            r = httpx.post(f"{url}/v1/{path}", json={"model": MODEL, **body}, headers=auth)
            err = r.json()["error"]
            assert r.status_code == 400 and "retry-after" not in r.headers, r.text
            assert (err["param"], err["code"]) == (param, "too_many_requests_in_one")
            assert "(4)" in err["message"]
        body = {"model": MODEL, "prompt": ["a", "b"], "n": 2}  # 4: at the bound, admitted
        r = httpx.post(f"{url}/v1/completions", json=body, headers=auth)
        assert r.status_code == 200 and len(r.json()["choices"]) == 4
    finally:
        loop.close()


def test_echo_with_logprobs_returns_the_prompt_and_its_logprobs(served, ref):
    c, _, _ = served
    prompt = "Paged attention keeps the cache in blocks"
    ids = ref.tokenizer.encode(prompt)
    out = c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2
    )
    engine = greedy(ref, prompt, 4, logprobs=2, prompt_logprobs=2)
    ch = out.choices[0]
    assert ch.text == prompt + engine.text
    lp = ch.logprobs
    n = len(ids)
    assert len(lp.tokens) == n + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # no context
    for i in range(1, n):
        assert lp.token_logprobs[i] == pytest.approx(engine.prompt_logprobs[i][0][1], abs=1e-5)
        assert len(lp.top_logprobs[i]) == 2
    for j in range(4):
        assert lp.token_logprobs[n + j] == pytest.approx(engine.logprobs[j][0][1], abs=1e-5)
    # offsets index the text: each token's string is found there at its offset, but BOS,
    # which the text leaves out: it sits at 0 and takes no room
    assert ids[0] == ref.tokenizer.bos_token_id and lp.tokens[0] == ref.tokenizer.bos_token
    assert lp.text_offset[:2] == [0, 0]
    whole = [t for t in lp.tokens[1:] if "\ufffd" not in t]  # (not part of a character)
    assert len(whole) >= n
    for at, tok in zip(lp.text_offset[1:], lp.tokens[1:]):
        if "\ufffd" not in tok:
            assert ch.text[at : at + len(tok)] == tok
    assert lp.text_offset[n] == len(prompt)  # the completion starts where the prompt ends
    # the same prompt again (now cached): the same values, as the cache is not read for it
    again = c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2
    )
    assert again.choices[0].logprobs.token_logprobs == lp.token_logprobs


def test_max_tokens_0_with_echo_scores_the_prompt_only(served, ref):
    c, _, app = served
    prompt = "Tenants share a pool of GPUs"
    out = c.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    ch = out.choices[0]
    assert ch.text == prompt and out.usage.completion_tokens == 0
    engine = greedy(ref, prompt, 1, prompt_logprobs=0)
    want = [None] + [e[0][1] for e in engine.prompt_logprobs[1:]]
    assert ch.logprobs.token_logprobs == pytest.approx(want, abs=1e-5)
    # streamed: the same text and values
    chunks = list(
        c.completions.create(
            model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=0, stream=True
        )
    )
    assert "".join(x.choices[0].text for x in chunks if x.choices) == prompt


def test_logit_bias_steers_completions_and_chat(served, ref):
    c, url, _ = served
    out = c.completions.create(
        model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logit_bias={"300": 100}
    )
    forced = ref.tokenizer.decode([300] * 4)
    assert out.choices[0].text == forced
    chat = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
        temperature=0, logit_bias={"300": 100},
    )  # fmt: skip
    assert chat.choices[0].message.content == ref.tokenizer.decode([300] * 3)
    vocab = ref.tokenizer.vocab_size
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1, "logit_bias": {str(vocab): 1}}
    r = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"


def test_cached_tokens_count_the_prefix_cache_hits_exactly(served, ref):
    c, url, _ = served
    prompt = " ".join(["fairness across tenants"] * 12)
    n = len(ref.tokenizer.encode(prompt))
    assert n > 2 * BLOCK
    first = c.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = c.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # whole blocks, and at least one token left to compute
    assert second.usage.prompt_tokens_details.cached_tokens == (n - 1) // BLOCK * BLOCK
    # the streamed usage says the same
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    r = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // BLOCK * BLOCK


def engine_of(app):
    return app.state.api.backend.engine.engine


def test_n_samples_fork_the_prompt_once_and_seeded_samples_are_reproducible(served, ref):
    from fairbatch.engine.sampling_params import sample_seed

    c, _, app = served
    prompt = "Parallel samples of one prompt share its blocks"
    forks = engine_of(app).scheduler.num_forks
    out = c.completions.create(model=MODEL, prompt=prompt, n=3, max_tokens=6, temperature=0)
    assert [ch.index for ch in out.choices] == [0, 1, 2]
    want = greedy(ref, prompt, 6).text
    assert [ch.text for ch in out.choices] == [want] * 3  # greedy: all alike
    assert out.usage.prompt_tokens == len(ref.tokenizer.encode(prompt))  # counted once
    assert out.usage.completion_tokens == 18
    assert engine_of(app).scheduler.num_forks == forks + 2  # siblings ran on sample 0's blocks
    # seeded: sample i is the lone run with sample_seed(seed, i); again the same
    kw = dict(model=MODEL, prompt=prompt, n=3, max_tokens=8, temperature=1.0, seed=11)
    seeded = [ch.text for ch in c.completions.create(**kw).choices]
    lone = [
        ref.generate(
            [prompt],
            SamplingParams(temperature=1.0, max_tokens=8, seed=sample_seed(11, i)),
            use_tqdm=False,
        )[0].text  # fmt: skip
        for i in range(3)
    ]
    assert seeded == lone and len(set(seeded)) > 1
    assert [ch.text for ch in c.completions.create(**kw).choices] == seeded


def test_n_with_a_prompt_list_and_chat_and_streams(served, ref):
    c, _, _ = served
    out = c.completions.create(model=MODEL, prompt=PROMPTS[:2], n=2, max_tokens=4, temperature=0)
    # OpenAI's order: the n choices of prompt 0, then those of prompt 1
    assert [ch.index for ch in out.choices] == [0, 1, 2, 3]
    texts = [greedy(ref, p, 4).text for p in PROMPTS[:2]]
    assert [ch.text for ch in out.choices] == [texts[0], texts[0], texts[1], texts[1]]
    msgs = [{"role": "user", "content": "Hi there"}]
    chat = c.chat.completions.create(model=MODEL, messages=msgs, n=2, max_tokens=5, seed=3)
    assert [ch.index for ch in chat.choices] == [0, 1]
    streamed = ["", ""]
    for chunk in c.chat.completions.create(
        model=MODEL, messages=msgs, n=2, max_tokens=5, seed=3, stream=True
    ):
        for ch in chunk.choices:
            streamed[ch.index] += ch.delta.content or ""
    assert streamed == [ch.message.content for ch in chat.choices]


def test_langchain_completions_llm_batch_and_generate(served, ref):
    """LangChain's completions LLM sends up to 20 prompts per request at its defaults."""
    lc = pytest.importorskip("langchain_openai")
    _, url, _ = served
    llm = lc.OpenAI(
        base_url=url + "/v1", api_key=KEY, model=MODEL, max_tokens=5, temperature=0,
        max_retries=0,
    )  # fmt: skip
    want = [greedy(ref, p, 5).text for p in PROMPTS[:3]]
    assert llm.batch(PROMPTS[:3]) == want
    result = llm.generate(PROMPTS[:2])
    assert [g[0].text for g in result.generations] == want[:2]
