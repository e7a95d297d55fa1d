"""The OpenAI-compatible API over a LocalBackend, through the official `openai` client over HTTP.

One tiny engine (weighted fair policy) serves several apps (one per config) on one background
event loop; every wait is bounded, nothing asserts on time.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import time

import httpx
import openai
import pytest
from loopback import ServerLoop

from fairbatch.deployments.api.backend import LocalBackend, create_app
from fairbatch.engine.llm import build_engine

MODEL = "fairbatch-tiny"
KEYS = {"bronze": "key-bronze", "silver": "key-silver", "gold": "key-gold"}
WEIGHTS = {"bronze": 1.0, "silver": 2.0, "gold": 4.0}
ADMIN = "admin-secret"
LONG = {"max_tokens": 1500, "ignore_eos": True}  # outlives any test step; always cancelled


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def env():
    loop = ServerLoop()
    backend = LocalBackend(
        build_engine("tiny", num_gpu_blocks=256, policy="weighted_fair", max_num_seqs=32)
    )
    yield loop, backend
    loop.run(backend.shutdown())
    loop.close()


def _tenants(**extra):
    return [{"name": n, "api_key": KEYS[n], "weight": WEIGHTS[n], **extra.get(n, {})} for n in KEYS]


@pytest.fixture(scope="module")
def main_app(env):
    loop, backend = env
    config = {"tenants": _tenants(), "admin_api_key": ADMIN, "allow_anonymous": True}
    app = create_app(backend, config)
    return app, loop.serve(app)


def client(url: str, key: str = "EMPTY") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def wait_for(pred, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def engine_idle(env) -> bool:
    loop, backend = env
    core = backend.engine.engine

    def idle() -> bool:
        return not core.has_unfinished() and core.scheduler.kv.all_free()

    return loop.run(backend.engine.call(idle))


def open_raw(url: str, path: str, body: dict, key: str | None) -> socket.socket:
    """Send a request on a raw socket (so the test decides exactly when the client leaves)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    data = json.dumps(body).encode()
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\n{auth}Content-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def read_until(sock: socket.socket, pattern: bytes, limit: int = 1 << 20) -> bytes:
    buf = b""
    while not re.search(pattern, buf):
        chunk = sock.recv(65536)  # bounded by the socket timeout
        if not chunk or len(buf) > limit:
            raise AssertionError(f"connection ended before {pattern!r}: {buf[-300:]!r}")
        buf += chunk
    return buf


def open_stream(url: str, key: str | None, **extra) -> tuple[socket.socket, str]:
    """A long streaming chat request that has produced its first token; (socket, id)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "stream": True}
    sock = open_raw(url, "/v1/chat/completions", {**body, **LONG, **extra}, key)
    buf = read_until(sock, rb'"content":"[^"]+')
    return sock, re.search(rb'"id":"(chatcmpl-[^"]+)"', buf).group(1).decode()


# ---- the happy paths ---------------------------------------------------------------------------


def test_models_list_and_retrieve(main_app):
    _, url = main_app
    c = client(url)
    assert [m.id for m in c.models.list().data] == [MODEL]
    assert c.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4")


def test_completion_usage_is_exact(env, main_app):
    _, url = main_app
    tok = env[1].tokenizer
    prompt = "fair batching keeps tenants apart"
    c = client(url, KEYS["gold"])
    r = c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.id.startswith("cmpl-") and len(r.id) >= 5 + 24
    assert r.object == "text_completion" and r.model == MODEL and r.created > 0
    assert r.choices[0].finish_reason == "length"
    n_prompt = len(tok.encode(prompt))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, 7)
    assert r.usage.total_tokens == n_prompt + 7
    # The same prompt as token ids gives the same text.
    r2 = c.completions.create(
        model=MODEL,
        prompt=tok.encode(prompt),
        max_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r2.choices[0].text == r.choices[0].text and r2.id != r.id


def test_chat_completion_usage_is_exact(env, main_app):
    _, url = main_app
    tok = env[1].tokenizer
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    r = client(url, KEYS["silver"]).chat.completions.create(
        model=MODEL,
        messages=messages,
        max_completion_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length"
    text = tok.apply_chat_template(messages)
    assert r.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))
    assert r.usage.completion_tokens == 5


def _chat_stream(c, **kwargs):
    parts, chunks = [], list(c.chat.completions.create(stream=True, **kwargs))
    for ch in chunks:
        for choice in ch.choices:
            parts.append(choice.delta.content or "")
    reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    return "".join(parts), chunks, reasons


def test_streaming_chat_equals_non_streaming(main_app):
    _, url = main_app
    c = client(url, KEYS["bronze"])
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "tell me about paged attention"}],
        max_tokens=24,
        temperature=0,
    )
    full = c.chat.completions.create(**kwargs)
    text, chunks, reasons = _chat_stream(c, **kwargs, stream_options={"include_usage": True})
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert reasons[-1] == full.choices[0].finish_reason and all(r is None for r in reasons[:-1])
    assert len({ch.id for ch in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"
    # include_usage: every chunk has usage null except the last, which has no choices.
    assert all(ch.usage is None for ch in chunks[:-1])
    streamed = chunks[-1].usage
    assert chunks[-1].choices == [] and streamed.total_tokens == full.usage.total_tokens
    assert streamed.completion_tokens == full.usage.completion_tokens
    # the same prompt a second time: its full blocks come from the prefix cache
    assert streamed.prompt_tokens_details.cached_tokens > 0
    # Without include_usage no chunk carries usage.
    _, plain, _ = _chat_stream(c, **kwargs)
    assert all(ch.usage is None for ch in plain)


def test_streaming_completion_equals_non_streaming(main_app):
    _, url = main_app
    c = client(url)
    kwargs = dict(model=MODEL, prompt="continuous batching", max_tokens=16, temperature=0)
    full = c.completions.create(**kwargs)
    chunks = list(c.completions.create(stream=True, **kwargs))
    assert "".join(ch.choices[0].text for ch in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_stop_sequences(main_app):
    _, url = main_app
    c = client(url)
    kwargs = dict(
        model=MODEL,
        prompt="stop here please",
        max_tokens=20,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    base = c.completions.create(**kwargs).choices[0].text
    start = next(i for i in range(4, len(base) - 3) if "\ufffd" not in base[i : i + 3])
    stop = base[start : start + 3]
    cut = base[: base.index(stop)]
    for form in (stop, ["never-appears-xyz", stop]):
        r = c.completions.create(stop=form, **kwargs)
        assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
        assert r.usage.completion_tokens < 20
    chunks = list(c.completions.create(stop=stop, stream=True, **kwargs))
    assert "".join(ch.choices[0].text for ch in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs_shapes(main_app):
    _, url = main_app
    c = client(url)
    r = c.completions.create(model=MODEL, prompt="log", max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(v <= 0 for v in lp.token_logprobs) and all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0
    ch = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = ch.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob
    plain = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2
    )
    assert plain.choices[0].logprobs is None


def test_seed_and_sampling_params(main_app):
    _, url = main_app
    c = client(url)
    kwargs = dict(
        model=MODEL,
        prompt="sampling",
        max_tokens=12,
        temperature=1.2,
        top_p=0.9,
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        extra_body={"top_k": 20, "ignore_eos": True},
    )
    a = c.completions.create(**kwargs).choices[0].text
    b = c.completions.create(**kwargs).choices[0].text
    assert a == b and a


def test_three_tenants_concurrent_streams_complete_and_are_charged_to_their_tenants(env, main_app):
    """Nine concurrent streams, three per tenant, each end with its 12 tokens, and every token
    is charged to the tenant whose key sent it, in the API's registry and in the engine's
    policy. No share or order is claimed: 9 requests fit the engine's 32 seats at once, so
    nothing contends (weighted shares under contention: tests/unit/test_scheduler.py
    test_weighted_fair_stays_within_vtc_bound_and_weights, tests/ray/test_serve_fairness.py)."""
    app, url = main_app
    loop, backend = env
    reg = app.state.registry
    policy = backend.engine.engine.scheduler.policy
    weights = loop.run(backend.engine.call(lambda: {n: policy.tenant(n).weight for n in KEYS}))
    assert weights == WEIGHTS  # the app pushed the configured tenants to the backend
    # Nothing else runs (or is still being released) while the tenants' charges are compared.
    wait_for(lambda: reg.total_in_flight == 0 and engine_idle(env), "the server to go idle")
    charged = {t: reg.tenants[t].tokens_charged for t in KEYS}
    decoded = loop.run(backend.engine.call(lambda: {t: policy.tokens()[t][1] for t in KEYS}))

    async def one(tenant: str, i: int) -> tuple[str, str, int, int]:
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEYS[tenant], max_retries=0)
        async with c:
            stream = await c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"{tenant} request {i}"}],
                max_tokens=12,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            reason, usage = None, None
            async for ch in stream:
                if ch.choices and ch.choices[0].finish_reason:
                    reason = ch.choices[0].finish_reason
                usage = ch.usage or usage
            return tenant, reason, usage.completion_tokens, usage.prompt_tokens

    async def all_of_them():
        jobs = [one(t, i) for i in range(3) for t in KEYS]
        return await asyncio.wait_for(asyncio.gather(*jobs), 120)

    results = asyncio.run(all_of_them())
    assert sorted(r[:3] for r in results) == sorted(
        (t, "length", 12) for t in KEYS for _ in range(3)
    )
    assert reg.total_in_flight == 0
    wait_for(lambda: engine_idle(env), "the engine to go idle")
    for t in KEYS:
        mine = [r for r in results if r[0] == t]
        assert reg.tenants[t].tokens_charged - charged[t] == sum(r[2] + r[3] for r in mine), t
    decoded_now = loop.run(backend.engine.call(lambda: {t: policy.tokens()[t][1] for t in KEYS}))
    assert {t: decoded_now[t] - decoded[t] for t in KEYS} == {t: 3 * 12 for t in KEYS}


# ---- disconnects, bounds, quotas -------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_and_frees_blocks(env, main_app, stream):
    app, url = main_app
    reg = app.state.registry
    body = {"model": MODEL, "prompt": "a long one", "stream": stream, **LONG}
    gold = reg.tenants["gold"]
    charged = gold.tokens_charged
    sock = open_raw(url, "/v1/completions", body, KEYS["gold"])
    if stream:
        read_until(sock, rb"data: \{")
    else:
        wait_for(lambda: reg.total_in_flight == 1 and not engine_idle(env), "the request to run")
    assert not engine_idle(env)
    sock.close()
    wait_for(lambda: reg.total_in_flight == 0, "the request to be released")
    wait_for(lambda: engine_idle(env), "the engine to abort it and free its blocks")
    env[0].run(env[1].engine.call(env[1].engine.engine.check_integrity))
    # Aborted, not run to the end: far fewer than max_tokens were generated.
    assert gold.tokens_charged - charged < LONG["max_tokens"] // 2


def test_queue_bounds_give_429_then_503(env):
    loop, backend = env
    limits = {"max_requests_per_tenant": 1, "max_requests_total": 2, "retry_after_s": 3}
    app = create_app(backend, {"tenants": _tenants(), "limits": limits})
    url = loop.serve(app)
    a, _ = open_stream(url, KEYS["bronze"])
    c = client(url, KEYS["bronze"])
    req = dict(model=MODEL, prompt="x", max_tokens=2)
    with pytest.raises(openai.RateLimitError) as e:
        c.completions.create(**req)
    assert e.value.response.headers["retry-after"] == "3"
    assert e.value.body["code"] == "tenant_queue_full"
    b, _ = open_stream(url, KEYS["silver"])
    with pytest.raises(openai.InternalServerError) as e:
        client(url, KEYS["gold"]).completions.create(**req)
    assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "3"
    a.close()
    b.close()
    wait_for(lambda: app.state.registry.total_in_flight == 0, "the streams to be released")
    assert client(url, KEYS["gold"]).completions.create(**req).usage.completion_tokens >= 1
    wait_for(lambda: engine_idle(env), "the engine to go idle")


def test_quota_gives_429_with_retry_after_until_refilled(env):
    loop, backend = env
    clock = FakeClock()
    tenants = _tenants(gold={"tokens_per_minute": 30})
    app = create_app(backend, {"tenants": tenants}, clock=clock)
    url = loop.serve(app)
    c = client(url, KEYS["gold"])
    req = dict(model=MODEL, prompt="quota", max_tokens=30, extra_body={"ignore_eos": True})
    r = c.completions.create(**req)  # a full bucket admits; this one goes into debt
    debt = r.usage.total_tokens - 30
    assert debt > 0
    with pytest.raises(openai.RateLimitError) as e:
        c.completions.create(**req)
    assert e.value.body["code"] == "quota_exceeded"
    assert int(e.value.response.headers["retry-after"]) == -(-debt * 60 // 30)
    assert client(url, KEYS["silver"]).completions.create(**req).usage  # others unaffected
    clock.t += 60.0  # a minute later the bucket is full again
    assert c.completions.create(**req).usage.completion_tokens == 30


# ---- isolation, admin, auth, logs ------------------------------------------------------------


def test_tenants_cannot_touch_each_others_requests(env, main_app):
    app, url = main_app
    sock, rid = open_stream(url, KEYS["gold"])
    assert rid.startswith("chatcmpl-")
    other = {"Authorization": f"Bearer {KEYS['bronze']}"}
    owner = {"Authorization": f"Bearer {KEYS['gold']}"}
    assert httpx.get(f"{url}/v1/requests/{rid}", headers=other).status_code == 404
    assert httpx.delete(f"{url}/v1/requests/{rid}", headers=other).status_code == 404
    assert httpx.delete(f"{url}/v1/requests/{rid}").status_code == 404  # anonymous
    assert app.state.registry.requests[rid].cancelled is False
    got = httpx.get(f"{url}/v1/requests/{rid}", headers=owner)
    assert got.status_code == 200 and got.json()["status"] == "running"
    assert httpx.delete(f"{url}/v1/requests/{rid}", headers=owner).json()["cancelled"] is True
    tail = read_until(sock, rb"data: \[DONE\]")
    assert b'"code":"request_cancelled"' in tail
    sock.close()
    wait_for(lambda: engine_idle(env), "the cancelled request's blocks to be freed")


def test_admin_endpoints_need_the_admin_key(env, main_app):
    app, url = main_app
    loop, backend = env
    assert httpx.get(f"{url}/admin/tenants").status_code == 401
    tenant_key = {"Authorization": f"Bearer {KEYS['gold']}"}
    assert httpx.get(f"{url}/admin/tenants", headers=tenant_key).status_code == 401
    patch = httpx.patch(f"{url}/admin/tenants/gold", json={"weight": 8}, headers=tenant_key)
    assert patch.status_code == 401
    admin = {"Authorization": f"Bearer {ADMIN}"}
    listing = httpx.get(f"{url}/admin/tenants", headers=admin)
    assert listing.status_code == 200
    assert {t["name"] for t in listing.json()["data"]} == {*KEYS, "default"}
    assert "key" not in listing.text and ADMIN not in listing.text
    body = {"weight": 8, "priority": 2, "tokens_per_minute": 6000}
    r = httpx.patch(f"{url}/admin/tenants/silver", json=body, headers=admin)
    assert r.status_code == 200 and r.json()["weight"] == 8.0
    assert r.json()["tokens_per_minute"] == 6000
    policy = backend.engine.engine.scheduler.policy
    spec = loop.run(backend.engine.call(policy.tenant, "silver"))
    assert (spec.weight, spec.priority) == (8.0, 2)  # reached the backend
    r = httpx.patch(
        f"{url}/admin/tenants/silver",
        json={"weight": 2, "priority": 0, "tokens_per_minute": None},
        headers=admin,
    )
    assert r.json()["tokens_per_minute"] is None and r.json()["weight"] == 2.0
    assert httpx.patch(f"{url}/admin/tenants/nobody", json={}, headers=admin).status_code == 404
    bad = httpx.patch(f"{url}/admin/tenants/gold", json={"weight": -1}, headers=admin)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "weight"
    no_admin = loop.serve(create_app(backend, {"tenants": _tenants()}))
    assert httpx.get(f"{no_admin}/admin/tenants", headers=admin).status_code == 403


def test_authentication(env):
    loop, backend = env
    digest = __import__("hashlib").sha256(b"hashed-key").hexdigest()
    tenants = [{"name": "h", "api_key_sha256": digest}]
    url = loop.serve(create_app(backend, {"tenants": tenants, "allow_anonymous": False}))
    req = dict(model=MODEL, prompt="auth", max_tokens=1)
    for key in ("EMPTY", "wrong-key"):
        with pytest.raises(openai.AuthenticationError):
            client(url, key).completions.create(**req)
    r = httpx.post(f"{url}/v1/completions", json=req)  # no header at all
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    basic = httpx.post(f"{url}/v1/completions", json=req, headers={"Authorization": "Basic x"})
    assert basic.status_code == 401
    assert client(url, "hashed-key").completions.create(**req).usage.completion_tokens == 1
    # The embedded default config lets anyone in as the default tenant.
    anon = loop.serve(create_app(backend))
    assert client(anon).completions.create(**req).usage.prompt_tokens > 0
    assert httpx.post(f"{anon}/v1/completions", json=req).status_code == 200


def test_no_keys_or_prompt_text_in_logs(main_app, caplog):
    _, url = main_app
    secret_prompt = "zebra-quartz-unique-prompt"
    with caplog.at_level(logging.DEBUG):
        c = client(url, KEYS["gold"])
        c.completions.create(model=MODEL, prompt=secret_prompt, max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            client(url, "leaked-key-123").completions.create(
                model=MODEL, prompt=secret_prompt, max_tokens=2
            )
        with pytest.raises(openai.BadRequestError):
            c.completions.create(model=MODEL, prompt=secret_prompt, max_tokens=2, temperature=9)
    text = caplog.text
    assert "request_id=cmpl-" in text  # the log is there...
    for secret in (secret_prompt, KEYS["gold"], "leaked-key-123"):
        assert secret not in text  # ...without keys or prompts


def test_overload_every_request_ends_with_tokens_or_retry_after(env):
    loop, backend = env
    limits = {"max_requests_per_tenant": 3, "max_requests_total": 4}
    app = create_app(backend, {"tenants": _tenants(), "limits": limits})
    url = loop.serve(app)

    async def one(ac: httpx.AsyncClient, tenant: str, i: int) -> tuple[int, str | None]:
        body = {"model": MODEL, "prompt": f"burst {i}", "max_tokens": 8, "ignore_eos": True}
        headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
        r = await ac.post("/v1/completions", json=body, headers=headers)
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] == 8
        return r.status_code, r.headers.get("retry-after")

    async def burst():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as ac:
            jobs = [one(ac, t, i) for i in range(8) for t in KEYS]  # 24 at once, 6x the bound
            return await asyncio.wait_for(asyncio.gather(*jobs), 120)

    results = asyncio.run(burst())
    statuses = [s for s, _ in results]
    assert set(statuses) <= {200, 429, 503} and len(results) == 24
    assert statuses.count(200) >= 4  # the bound admits, it does not starve
    assert all(ra is not None and int(ra) >= 1 for s, ra in results if s != 200)
    reg = app.state.registry
    assert reg.total_in_flight == 0 and reg.rejected_total == statuses.count(429) + statuses.count(
        503
    )
    wait_for(lambda: engine_idle(env), "the engine to go idle")


def test_admin_stats_count_prefix_hits_of_a_repeated_prompt(env, main_app):
    _, url = main_app
    admin = {"Authorization": f"Bearer {ADMIN}"}
    assert (
        httpx.get(f"{url}/admin/stats", headers={"Authorization": "Bearer key-gold"}).status_code
        == 401
    )
    wait_for(lambda: engine_idle(env), "an idle engine")
    before = httpx.get(f"{url}/admin/stats", headers=admin).json()
    prompt = "the same long system prompt, sent twice by one tenant " * 4
    c = client(url, KEYS["gold"])
    first = c.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    c.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    after = httpx.get(f"{url}/admin/stats", headers=admin).json()
    n = first.usage.prompt_tokens
    block = 16  # build_engine's default block size
    # The second request finds every full block of its prompt but the one holding its last
    # token (at least one token is always computed).
    hits = (n - 1) // block * block
    assert after["object"] == "stats"
    assert after["engine"]["prefix_hit_tokens"] - before["engine"]["prefix_hit_tokens"] == hits
    assert hits >= 2 * block
    assert after["engine"]["preemptions"] == before["engine"]["preemptions"]
    assert after["engine"]["running"] == 0 and after["in_flight"] == 0


def test_prefix_cache_is_shared_within_a_group_and_nowhere_else(env):
    """Tenants of one `prefix_cache_group` hit each other's cached prompt blocks (the exact
    count of a repeat); tenants in no group never hit another tenant's blocks, nor the
    group's, nor the group theirs. The repeat by the same tenant shows the cache is on."""
    loop, backend = env
    tenants = [
        {"name": "team-a", "api_key": "key-team-a", "prefix_cache_group": "team"},
        {"name": "team-b", "api_key": "key-team-b", "prefix_cache_group": "team"},
        {"name": "solo-c", "api_key": "key-solo-c"},
        {"name": "solo-d", "api_key": "key-solo-d"},
    ]
    app = create_app(backend, {"tenants": tenants, "admin_api_key": ADMIN})
    url = loop.serve(app)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    wait_for(lambda: engine_idle(env), "an idle engine")

    def hits() -> int:
        return httpx.get(f"{url}/admin/stats", headers=admin).json()["engine"]["prefix_hit_tokens"]

    def hit_by(key: str, prompt: str) -> tuple[int, int]:
        """(prefix-hit tokens of this one request, its prompt tokens)"""
        before = hits()
        r = client(url, key).completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        return hits() - before, r.usage.prompt_tokens

    shared = "a long system prompt that two tenants of one group both send, " * 4
    private = "a long system prompt that two tenants without a group both send, " * 4
    assert hit_by("key-team-a", shared)[0] == 0  # first sight
    got, n = hit_by("key-team-b", shared)
    assert got == (n - 1) // 16 * 16 >= 32  # every full block but the last token's
    assert hit_by("key-solo-c", shared)[0] == 0  # the group's blocks are not c's
    assert hit_by("key-solo-c", private)[0] == 0
    assert hit_by("key-solo-d", private)[0] == 0  # c's blocks are not d's
    assert hit_by("key-team-a", private)[0] == 0  # nor the group's
    got, n = hit_by("key-solo-d", private)  # but d's own repeat hits: the cache is on
    assert got == (n - 1) // 16 * 16
    assert app.state.registry.total_in_flight == 0
    wait_for(lambda: engine_idle(env), "the engine to go idle")


@pytest.mark.parametrize("interval_ms", [0, 200])
def test_coalesced_stream_is_the_same_completion_with_aligned_logprobs(env, interval_ms):
    """`stream_interval_ms` merges a request's deltas into fewer SSE chunks: the same text and
    logprobs as the non-streamed completion, every chunk's logprobs with its own text."""
    loop, _ = env
    app = create_app(env[1], {"stream_interval_ms": interval_ms})
    c = client(loop.serve(app))
    kwargs = dict(model=MODEL, prompt="coalesce these", max_tokens=32, temperature=0, logprobs=1)
    kwargs["extra_body"] = {"ignore_eos": True}
    full = c.completions.create(**kwargs).choices[0]
    chunks = [ch.choices[0] for ch in c.completions.create(stream=True, **kwargs) if ch.choices]
    assert "".join(ch.text for ch in chunks) == full.text
    streamed = [t for ch in chunks if ch.logprobs for t in ch.logprobs.token_logprobs]
    assert streamed == pytest.approx(full.logprobs.token_logprobs)  # all 32, in order
    for ch in chunks:  # a chunk never carries tokens whose text is held back for later
        if ch.logprobs and ch.logprobs.tokens:
            assert ch.text != "" or ch.finish_reason is not None
    content = [ch for ch in chunks if ch.text]
    print(f"interval {interval_ms} ms: {len(content)} chunks with text for 32 tokens")
    if interval_ms == 0:
        assert len(content) >= 24  # about one chunk per token (a few wait for their text)
    else:  # 32 tokens of the tiny model take far less than 200 ms a chunk
        assert len(content) <= 16
