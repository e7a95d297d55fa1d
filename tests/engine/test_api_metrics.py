"""GET /metrics of the API app over a LocalBackend (tiny engine), served on loopback.

Two tenants send a few completions (one of them streamed); the exposition must parse, count
exactly what was sent and what the responses reported, and show the engine's state as
/admin/stats has it at the same idle moment. Gating and per-app registries are checked too.
"""

from __future__ import annotations

import json
import socket

import httpx
import openai
import pytest
from loopback import ServerLoop, wait_for
from prometheus_client.parser import text_string_to_metric_families

from fairbatch.deployments.api.backend import LocalBackend, create_app
from fairbatch.deployments.api.config import ConfigError, parse_config
from fairbatch.engine.llm import build_engine

MODEL = "fairbatch-tiny"
ADMIN = "metrics-admin"
TENANTS = [
    {"name": "alice", "api_key": "key-alice", "weight": 1.0},
    {"name": "bob", "api_key": "key-bob", "weight": 2.0},
]
EXACT = {"ignore_eos": True}  # every request runs to max_tokens: finish_reason "length"


@pytest.fixture(scope="module")
def env():
    loop = ServerLoop()
    backend = LocalBackend(
        build_engine("tiny", num_gpu_blocks=256, policy="weighted_fair", max_num_seqs=16)
    )
    yield loop, backend
    loop.run(backend.shutdown())
    loop.close()


def serve(env, **config):
    loop, backend = env
    return loop.serve(create_app(backend, {"tenants": TENANTS, **config}))


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def engine_idle(env) -> bool:
    loop, backend = env
    core = backend.engine.engine

    def idle() -> bool:
        return not core.has_unfinished() and core.scheduler.kv.all_free()

    return loop.run(backend.engine.call(idle))


def scrape(url: str, key: str | None = None) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one GET /metrics."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.get(f"{url}/metrics", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def test_metrics_count_what_was_sent_and_show_the_engine(env):
    url = serve(env, admin_api_key=ADMIN)
    assert (
        value(scrape(url), "fairbatch_requests_total", tenant="alice", finish_reason="length")
        is None
    )

    usage: dict[str, list[tuple[int, int]]] = {"alice": [], "bob": []}
    alice, bob = client(url, "key-alice"), client(url, "key-bob")
    for prompt, n in (
        ("the first prompt of alice", 3),
        ("another one, a bit longer, from alice", 5),
    ):
        r = alice.completions.create(model=MODEL, prompt=prompt, max_tokens=n, extra_body=EXACT)
        usage["alice"].append((r.usage.prompt_tokens, r.usage.completion_tokens))
    msgs = [{"role": "user", "content": "hello from bob"}]
    r = bob.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, extra_body=EXACT)
    usage["bob"].append((r.usage.prompt_tokens, r.usage.completion_tokens))
    stream = bob.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=EXACT,
    )
    last = None
    for chunk in stream:
        last = chunk
    usage["bob"].append((last.usage.prompt_tokens, last.usage.completion_tokens))

    wait_for(lambda: engine_idle(env), 30, "an idle engine", every=0.02)
    stats = httpx.get(f"{url}/admin/stats", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    m = scrape(url)
    for tenant, runs in usage.items():
        assert value(m, "fairbatch_requests_total", tenant=tenant, finish_reason="length") == 2
        assert value(m, "fairbatch_tokens_total", tenant=tenant, kind="prompt") == sum(
            p for p, _ in runs
        )
        assert value(m, "fairbatch_tokens_total", tenant=tenant, kind="completion") == sum(
            c for _, c in runs
        )
        for hist in ("fairbatch_ttft_seconds", "fairbatch_tpot_seconds"):
            assert value(m, hist + "_count", tenant=tenant) == 2
            assert value(m, hist + "_bucket", tenant=tenant, le="+Inf") == 2
        e2e = {"tenant": tenant, "finish_reason": "length"}
        assert value(m, "fairbatch_e2e_latency_seconds_count", **e2e) == 2
        assert value(m, "fairbatch_e2e_latency_seconds_sum", **e2e) > 0
        assert value(m, "fairbatch_rejections_total", tenant=tenant) == 0
    reasons = {lab for (name, lab) in m if name == "fairbatch_requests_total"}
    assert len(reasons) == 2  # nothing else was counted

    e = stats["engine"]
    assert value(m, "fairbatch_queue_depth") == e["waiting"] == 0
    assert value(m, "fairbatch_running_seqs") == e["running"] == 0
    assert value(m, "fairbatch_swapped_seqs") == e["swapped"]
    assert value(m, "fairbatch_kv_usage_ratio") == pytest.approx(e["kv_usage"])
    assert value(m, "fairbatch_prefix_hit_tokens_total") == e["prefix_hit_tokens"]
    assert value(m, "fairbatch_host_tier_hit_tokens_total") == e["host_tier"]["hit_tokens"]
    for mode, n in e["preemptions"].items():
        assert value(m, "fairbatch_preemptions_total", mode=mode) == n
    for direction, n in e["swapped_bytes"].items():
        assert value(m, "fairbatch_swapped_bytes_total", direction=direction) == n
    for tenant in usage:
        assert e["tenant_service"][tenant] > 0
    for name, key in (
        ("fairbatch_tenant_service_tokens", "tenant_service"),
        ("fairbatch_tenant_virtual_counter", "tenant_counters"),
    ):
        shown = {dict(lab)["tenant"]: v for (n, lab), v in m.items() if n == name}
        assert shown == e[key]


def test_a_client_that_leaves_is_counted_in_its_own_app(env):
    """client_gone is an outcome; the other app's registry never sees this request."""
    url = serve(env)
    host, port = url.removeprefix("http://").split(":")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "stream": True}
    data = json.dumps({**body, "max_tokens": 1500, "ignore_eos": True}).encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer key-alice"
        f"\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    buf = b""
    while b'"content":"' not in buf.replace(b'"content":""', b""):
        chunk = sock.recv(65536)
        assert chunk, buf[-300:]
        buf += chunk
    sock.close()
    gone = {"tenant": "alice", "finish_reason": "client_gone"}
    wait_for(lambda: value(scrape(url), "fairbatch_requests_total", **gone) == 1, 30, "client_gone")
    m = scrape(url)
    assert value(m, "fairbatch_ttft_seconds_count", tenant="alice") == 1
    assert [k for k in m if k[0] == "fairbatch_requests_total"] == [
        ("fairbatch_requests_total", tuple(sorted(gone.items())))
    ]
    wait_for(lambda: engine_idle(env), 30, "an idle engine", every=0.02)


def test_metrics_gated_by_the_admin_key_or_off(env):
    url = serve(env, admin_api_key=ADMIN, metrics={"require_admin_key": True})
    assert httpx.get(f"{url}/metrics").status_code == 401
    tenant_key = {"Authorization": "Bearer key-alice"}
    assert httpx.get(f"{url}/metrics", headers=tenant_key).status_code == 401
    m = scrape(url, ADMIN)
    assert value(m, "fairbatch_running_seqs") == 0
    assert not [k for k in m if k[0] == "fairbatch_requests_total"]  # a fresh app's registry

    off = serve(env, metrics={"enabled": False})
    assert httpx.get(f"{off}/metrics").status_code == 404
    with pytest.raises(ConfigError, match="metrics.require_admin_key"):
        parse_config({"metrics": {"require_admin_key": True}})
