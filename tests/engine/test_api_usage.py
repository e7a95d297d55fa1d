"""Usage records of the one-engine server (deployments/usage.py), served on loopback.

Two tenants run a mixed load on an engine whose KV pool is small enough that requests are
preempted: plain and streamed completions and chats, n=2, a request with two prompts, and a
stream its client drops. Each response's usage must equal the sum of its requests' records,
token for token; the records' preemptions must add up to the engine's own count; and
GET /admin/usage must sum the records per tenant over a period (bad periods: 400)."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from loopback import ServerLoop, wait_for
from prometheus_client.parser import text_string_to_metric_families

from fairbatch.deployments.api.backend import LocalBackend, create_app
from fairbatch.engine.llm import build_engine

MODEL = "fairbatch-tiny"
ADMIN = "usage-admin"
TENANTS = [
    {"name": "alice", "api_key": "key-alice"},
    {"name": "bob", "api_key": "key-bob"},
]
PROMPT = "a prompt of some length so that a few of them fill the small pool " * 2


@pytest.fixture(scope="module")
def env():
    loop = ServerLoop()
    # 12 blocks of 16 tokens: about two of these requests at once; the rest are preempted
    backend = LocalBackend(build_engine("tiny", num_gpu_blocks=12, max_num_seqs=8))
    yield loop, backend
    loop.run(backend.shutdown())
    loop.close()


def post(url: str, key: str, path: str, body: dict) -> dict:
    r = httpx.post(f"{url}{path}", json=body, headers=auth(key), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def stream(url: str, key: str, path: str, body: dict, stop_after: int | None = None) -> list:
    """The SSE bodies of a streamed request; the client hangs up after `stop_after` chunks."""
    chunks = []
    with httpx.stream(
        "POST", f"{url}{path}", json={**body, "stream": True}, headers=auth(key), timeout=120
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks.append(json.loads(line[6:]))
            if stop_after is not None and len(chunks) >= stop_after:
                break
    return chunks


def records(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def engine_idle(env) -> bool:
    loop, backend = env
    core = backend.engine.engine
    return loop.run(backend.engine.call(lambda: not core.has_unfinished()))


def test_records_add_up_to_what_clients_were_told(env, tmp_path):
    loop, backend = env
    log_path = tmp_path / "usage.jsonl"
    config = {"tenants": TENANTS, "admin_api_key": ADMIN, "usage": {"path": str(log_path)}}
    url = loop.serve(create_app(backend, config))
    before = backend.engine.engine.stats()["preemptions"]
    long = {"max_tokens": 48, "ignore_eos": True}
    jobs = [
        ("key-alice", "/v1/completions", {"model": MODEL, "prompt": PROMPT, **long}),
        ("key-alice", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "n": 2, **long}),
        ("key-alice", "/v1/completions", {"model": MODEL, "prompt": [PROMPT, "short"], **long}),
        (
            "key-bob",
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], **long},
        ),
        ("key-bob", "/v1/completions", {"model": MODEL, "prompt": PROMPT + "!", **long}),
    ]
    streamed = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell me"}],
        "stream_options": {"include_usage": True},
        **long,
    }
    with ThreadPoolExecutor(8) as pool:
        replies = [pool.submit(post, url, *job) for job in jobs]
        full = pool.submit(stream, url, "key-alice", "/v1/chat/completions", streamed)
        answered = [r.result() for r in replies]
        full_chunks = full.result()
    answered.append({"id": full_chunks[-1]["id"], "usage": full_chunks[-1]["usage"]})
    wait_for(lambda: engine_idle(env), 60, "an idle engine", every=0.05)
    # 5 replies of 1, 2, 2, 1, 1 requests, and the full stream
    got = wait_for(lambda: len(records(log_path)) == 8 and records(log_path), 30, "8 records")
    after = backend.engine.engine.stats()["preemptions"]
    preempted = sum(after.values()) - sum(before.values())
    assert preempted > 0  # the small pool did preempt
    assert sum(r["preemptions"] for r in got) == preempted  # each one, on its request

    by_response: dict[str, list[dict]] = {}
    for r in got:
        by_response.setdefault(r["response_id"], []).append(r)
        assert r["model"] == MODEL and r["replica"] is None and r["moves"] == 0
        assert r["arrival"] <= r["first_token"] <= r["end"] <= time.time()
    for reply in answered:
        rows = by_response.pop(reply["id"])
        usage = reply["usage"]
        assert sum(r["prompt_tokens"] for r in rows) == usage["prompt_tokens"]
        assert sum(r["output_tokens"] for r in rows) == usage["completion_tokens"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert sum(r["cached_tokens"] for r in rows) == cached
        assert {r["finish_reason"] for r in rows} == {"length"}
        assert len({r["tenant"] for r in rows}) == 1
    assert not by_response
    assert sum(r["prompt_tokens"] == 0 for r in got) == 1  # the n=2 reply's second sample

    # a stream its client drops: recorded as such, with the tokens it had produced
    cut = stream(url, "key-bob", "/v1/completions", {"model": MODEL, "prompt": PROMPT, **long}, 3)
    wait_for(lambda: engine_idle(env), 60, "an idle engine", every=0.05)
    got = wait_for(lambda: len(records(log_path)) == 9 and records(log_path), 30, "9 records")
    dropped = got[-1]
    assert dropped["response_id"] == cut[0]["id"] and dropped["tenant"] == "bob"
    assert dropped["finish_reason"] == "client_gone" and 3 <= dropped["output_tokens"] < 48

    # GET /admin/usage: the records summed per tenant
    def summary(**params) -> httpx.Response:
        return httpx.get(f"{url}/admin/usage", params=params, headers=auth(ADMIN), timeout=30)

    body = summary().json()
    assert body["object"] == "usage" and set(body["tenants"]) == {"alice", "bob"}
    for tenant, sums in body["tenants"].items():
        rows = [r for r in got if r["tenant"] == tenant]
        assert sums["requests"] == len(rows)
        for key in ("prompt_tokens", "cached_tokens", "output_tokens", "reasoning_tokens"):
            assert sums[key] == sum(r[key] for r in rows)
    assert set(summary(tenant="bob").json()["tenants"]) == {"bob"}
    ends = sorted(r["end"] for r in got)
    later = summary(since=str(ends[-1])).json()["tenants"]
    assert sum(s["requests"] for s in later.values()) == ends.count(ends[-1])
    assert summary(until="1970-01-02T00:00:00Z").json()["tenants"] == {}
    for params, field in [({"since": "soon"}, "since"), ({"since": "5", "until": "5"}, "since"),
                          ({"until": "inf"}, "until")]:  # fmt: skip
        r = summary(**params)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert httpx.get(f"{url}/admin/usage", headers=auth("key-alice")).status_code == 401

    # Prometheus: tenants are labels, request ids never are (the series stay bounded)
    text = httpx.get(f"{url}/metrics", timeout=30).text
    labels = {
        (name, value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        for name, value in sample.labels.items()
    }
    assert {v for n, v in labels if n == "tenant"} == {"alice", "bob"}
    allowed = {"tenant", "finish_reason", "kind", "stage", "mode", "direction", "event", "le"}
    assert {n for n, _ in labels} <= allowed
    ids = {r["request_id"] for r in got} | {r["response_id"] for r in got}
    assert not [v for _, v in labels if v in ids]


def test_usage_summary_without_a_log_says_how_to_turn_it_on(env):
    loop, backend = env
    url = loop.serve(create_app(backend, {"tenants": TENANTS, "admin_api_key": ADMIN}))
    r = httpx.get(f"{url}/admin/usage", headers=auth(ADMIN), timeout=30)
    assert r.status_code == 404 and "usage.path" in r.json()["error"]["message"]


def test_handle_calls_are_admitted_and_recorded_as_http_requests_are(env, tmp_path):
    """The handle API goes through the same door: its calls count against the tenant's
    in-flight bound, and their usage records match what the caller was told."""
    from fairbatch.deployments.serve.handle_api import HandleApi, HandleRejected

    loop, backend = env
    log_path = tmp_path / "usage.jsonl"
    tenants = [{**TENANTS[0], "max_requests": 1}, TENANTS[1]]
    config = {"tenants": tenants, "admin_api_key": ADMIN, "usage": {"path": str(log_path)}}
    app = create_app(backend, config)
    loop.serve(app)  # (its lifespan binds the backend)

    class Ingress(HandleApi):
        api_app = app

    ingress = Ingress()
    call = {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True}
    whole = loop.run(ingress.complete({**call, "tenant": "alice", "request_id": "mine-1"}))

    async def two_at_once() -> list:
        async def stream(rid: str) -> list:
            return [c async for c in ingress.generate({**call, "tenant": "alice",
                                                       "request_id": rid})]  # fmt: skip

        return await asyncio.gather(stream("mine-2"), stream("mine-3"), return_exceptions=True)

    first, second = loop.run(two_at_once())
    refused = [x for x in (first, second) if isinstance(x, HandleRejected)]
    assert len(refused) == 1 and refused[0].status == 429  # alice may have one in flight

    async def broken_off() -> str:
        stream = ingress.generate({**call, "tenant": "bob", "request_id": "mine-4"})
        chunk = await stream.__anext__()
        await stream.aclose()
        return chunk["id"]

    assert loop.run(broken_off()) == "mine-4"
    wait_for(lambda: engine_idle(env), 60, "an idle engine", every=0.05)
    rows = wait_for(lambda: len(records(log_path)) == 3 and records(log_path), 30, "3 records")
    got = {r["request_id"]: r for r in rows}
    served = next(x for x in (first, second) if not isinstance(x, HandleRejected))
    one = got.pop("mine-1")
    assert (one["prompt_tokens"], one["output_tokens"]) == (
        whole["usage"]["prompt_tokens"], whole["usage"]["completion_tokens"])  # fmt: skip
    two = got.pop(served[-1]["id"])
    assert two["output_tokens"] == served[-1]["usage"]["completion_tokens"] == 12
    assert (two["finish_reason"], two["model"], two["tenant"]) == ("length", MODEL, "alice")
    gone = got.pop("mine-4")
    assert gone["finish_reason"] == "client_gone" and gone["tenant"] == "bob"
    assert not got  # the refused call never ran: no record
