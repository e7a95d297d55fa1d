"""The API against scripted backends (no torch): the backend protocol's contract, and what the
client sees when a backend fails, aborts, hangs or refuses. Every wait is bounded.

The scripted backend yields `RequestDelta`s as the cluster client does (no logprobs, several
tokens per item), so this also checks the API takes what `ClusterClient.generate` streams."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time

import httpx
import pytest
from loopback import ServerLoop

from fairbatch.deployments.api.backend import bind_backend, create_app
from fairbatch.engine.outputs import RequestDelta
from fairbatch.engine.tokenizer import Tokenizer

MODEL = "fairbatch-tiny"


class ScriptedBackend:
    """Yields `script` deltas per request; `mode` decides how a request ends."""

    def __init__(self) -> None:
        self.tokenizer = Tokenizer.tiny()
        self.max_model_len = 128
        self.mode = "ok"
        self.healthy = True
        self.calls: list[dict] = []  # generate() arguments
        self.closed: list[str] = []  # request ids whose stream was closed unfinished
        self.aborted: list[str] = []
        self.tenant_updates: list[tuple] = []
        self.refuse_updates = False
        self._release: dict[str, asyncio.Event] = {}

    async def generate(self, prompt_token_ids, params, *, request_id, tenant, priority):
        self.calls.append(dict(ids=list(prompt_token_ids), params=params, rid=request_id,
                               tenant=tenant, priority=priority))  # fmt: skip
        finished = False
        try:
            if self.mode == "refuse":
                raise ValueError("the backend refuses this prompt")
            if self.mode == "fail_start":
                raise RuntimeError("replica died")
            if self.mode == "fail_first":  # an error item before any token (admission failed)
                finished = True
                yield RequestDelta("r", [], "", True, "error", error="admission failed")
                return
            yield RequestDelta("r", [65], "A", False)
            if self.mode == "fail_mid":
                raise RuntimeError("replica died mid-stream")
            if self.mode == "abort":
                finished = True
                yield RequestDelta("r", [], "", True, "abort")
                return
            if self.mode == "hang":
                event = self._release.setdefault(request_id, asyncio.Event())
                await event.wait()  # until closed or aborted
                finished = True
                yield RequestDelta("r", [], "", True, "abort")
                return
            finished = True
            yield RequestDelta("r", [66, 67], "BC", True, "length")
        finally:
            if not finished:
                self.closed.append(request_id)

    async def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        event = self._release.get(request_id)
        if event is not None:
            event.set()
        return event is not None

    def update_tenant(self, name, weight, priority, tokens_per_minute, max_requests, change):
        if self.refuse_updates:
            raise RuntimeError("controller unreachable")
        self.tenant_updates.append((name, weight, priority, tokens_per_minute))

    def check_health(self) -> bool:
        return self.healthy


TENANTS = [
    {"name": "a", "api_key": "ka", "weight": 2, "priority": 3, "tokens_per_minute": 600},
    {"name": "b", "api_key": "kb"},
]


@pytest.fixture(scope="module")
def served():
    loop = ServerLoop()
    backend = ScriptedBackend()
    app = create_app(backend, {"tenants": TENANTS, "admin_api_key": "adm"})
    url = loop.serve(app)
    with httpx.Client(base_url=url, timeout=30, headers={"Authorization": "Bearer ka"}) as c:
        yield c, backend, app
    loop.close()


@pytest.fixture(autouse=True)
def reset(served):
    backend = served[1]
    backend.mode, backend.healthy, backend.refuse_updates = "ok", True, False
    yield
    registry = served[2].state.registry
    deadline = time.monotonic() + 10
    while registry.total_in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert registry.total_in_flight == 0  # every test leaves no request behind


def comp(**kw):
    return {"model": MODEL, "prompt": "hello", "max_tokens": 4, **kw}


def sse_events(text: str) -> list:
    return [
        line[6:] if line[6:] == "[DONE]" else json.loads(line[6:])
        for line in text.splitlines()
        if line.startswith("data: ")
    ]


def test_backend_receives_ids_params_tenant_and_priority(served):
    c, backend, _ = served
    r = c.post("/v1/completions", json=comp(temperature=0.5, seed=3, stop=["x"]))
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ABC"
    call = backend.calls[-1]
    assert call["ids"] == backend.tokenizer.encode("hello")
    assert (call["tenant"], call["priority"]) == ("a", 3)
    assert call["rid"] == r.json()["id"]
    p = call["params"]
    assert (p.max_tokens, p.temperature, p.seed, p.stop) == (4, 0.5, 3, ["x"])
    n = len(call["ids"])
    assert r.json()["usage"] == {
        "prompt_tokens": n,
        "completion_tokens": 3,
        "total_tokens": n + 3,
        "prompt_tokens_details": {"cached_tokens": 0},  # the scripted backend reports none
    }


def test_tenants_pushed_at_startup(served):
    backend = served[1]
    assert ("a", 2.0, 3, 600.0) in backend.tenant_updates
    assert ("b", 1.0, 0, None) in backend.tenant_updates
    # Tenants have keys and the config says nothing of anonymous access: there is no
    # anonymous tenant to push.
    assert {u[0] for u in backend.tenant_updates} == {"a", "b"}


def test_backend_refusal_is_400(served):
    c, backend, app = served
    backend.mode = "refuse"
    charged = app.state.registry.tenants["a"].tokens_charged
    r = c.post("/v1/completions", json=comp())
    assert r.status_code == 400 and "refuses" in r.json()["error"]["message"]
    assert app.state.registry.tenants["a"].tokens_charged == charged  # the prompt is refunded


@pytest.mark.parametrize("mode", ["fail_start", "fail_first", "fail_mid", "abort"])
def test_backend_failure_is_503_not_500(served, mode):
    c, backend, _ = served
    backend.mode = mode
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "backend_unavailable"


@pytest.mark.parametrize("mode", ["fail_start", "fail_first"])
def test_backend_failure_before_the_first_token_is_503_when_streaming_too(served, mode):
    """Nothing was streamed yet: the client gets a status it can retry on, not a 200 whose
    stream holds only an error event."""
    c, backend, _ = served
    backend.mode = mode
    r = c.post("/v1/completions", json=comp(stream=True))
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "backend_unavailable"


@pytest.mark.parametrize("mode", ["fail_mid", "abort"])
def test_backend_failure_mid_stream_ends_with_an_error_event(served, mode):
    c, backend, _ = served
    backend.mode = mode
    r = c.post("/v1/completions", json=comp(stream=True))
    events = sse_events(r.text)
    assert events[0]["choices"][0]["text"] == "A"
    assert events[-2]["error"]["code"] == "backend_unavailable" and events[-1] == "[DONE]"


def test_health_follows_the_backend(served):
    c, backend, _ = served
    assert c.get("/health").status_code == 200
    backend.healthy = False
    assert c.get("/health").status_code == 503


def wait_until(pred, what: str) -> None:
    deadline = time.monotonic() + 10
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_closes_the_backend_stream(served, stream):
    c, backend, _ = served
    backend.mode = "hang"
    n_calls = len(backend.calls)
    url = str(c.base_url).rstrip("/")
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(comp(stream=stream)).encode()
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer kb\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    wait_until(lambda: len(backend.calls) > n_calls, "the request to reach the backend")
    if stream:
        assert b"data: " in sock.recv(65536)  # the first chunk came; then the backend hangs
    sock.close()  # the client goes away
    rid = backend.calls[-1]["rid"]
    wait_until(lambda: rid in backend.closed, "the backend stream to be closed")


def test_a_cancel_reaches_the_backend_and_ends_the_stream(served):
    c, backend, app = served
    backend.mode = "hang"

    async def run() -> tuple[list, int, int]:
        async with httpx.AsyncClient(base_url=str(c.base_url), timeout=10) as ac:
            async with ac.stream("POST", "/v1/completions", json=comp(stream=True),
                                 headers={"Authorization": "Bearer ka"}) as r:  # fmt: skip
                lines = r.aiter_lines()
                first = await asyncio.wait_for(anext(lines), 10)
                rid = json.loads(first[6:])["id"]
                other = await ac.delete(
                    f"/v1/requests/{rid}", headers={"Authorization": "Bearer kb"}
                )
                mine = await ac.delete(
                    f"/v1/requests/{rid}", headers={"Authorization": "Bearer ka"}
                )
                rest = [line async for line in lines]
                return rest, other.status_code, mine.status_code

    rest, other, mine = asyncio.run(asyncio.wait_for(run(), 20))
    assert (other, mine) == (404, 200)
    events = sse_events("\n".join(rest))
    assert events[-2]["error"]["code"] == "request_cancelled" and events[-1] == "[DONE]"
    assert backend.calls[-1]["rid"] in backend.aborted


def test_admin_update_reaches_backend_or_is_rolled_back(served):
    c, backend, app = served
    admin = {"Authorization": "Bearer adm"}
    r = c.patch("/admin/tenants/b", json={"weight": 5, "tokens_per_minute": 100}, headers=admin)
    assert r.status_code == 200 and backend.tenant_updates[-1] == ("b", 5.0, 0, 100.0)
    backend.refuse_updates = True
    r = c.patch("/admin/tenants/b", json={"weight": 9}, headers=admin)
    assert r.status_code == 502 and r.json()["error"]["type"] == "server_error"
    state = app.state.registry.tenants["b"]
    assert (state.weight, state.tokens_per_minute) == (5.0, 100.0)  # unchanged
    backend.refuse_updates = False
    assert c.patch("/admin/tenants/b", json={"extra": 1}, headers=admin).status_code == 400


def test_an_app_built_before_its_backend_answers_503_until_bound():
    loop = ServerLoop()
    try:
        app = create_app(None, {"tenants": TENANTS})
        url = loop.serve(app)
        with httpx.Client(base_url=url, timeout=10) as c:
            assert c.get("/health").status_code == 503
            r = c.post("/v1/completions", json=comp(), headers={"Authorization": "Bearer kb"})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "backend_unavailable"
            backend = ScriptedBackend()
            loop.run(bind_backend(app, backend))
            assert ("a", 2.0, 3, 600.0) in backend.tenant_updates
            assert c.get("/health").status_code == 200
            r = c.post("/v1/completions", json=comp(), headers={"Authorization": "Bearer kb"})
            assert r.status_code == 200 and backend.calls[-1]["tenant"] == "b"
    finally:
        loop.close()


class SaltRecordingBackend(ScriptedBackend):
    """A backend that takes the optional `cache_salt` kwarg and records whether it came."""

    def __init__(self) -> None:
        super().__init__()
        self.salts: dict[str, tuple[bool, str | None]] = {}  # tenant -> (passed, salt)

    async def generate(self, prompt_token_ids, params, *, request_id, tenant, priority, **kw):
        self.salts[tenant] = ("cache_salt" in kw, kw.get("cache_salt"))
        async for d in super().generate(
            prompt_token_ids, params, request_id=request_id, tenant=tenant, priority=priority
        ):
            yield d


def test_cache_salt_reaches_the_backend_only_for_tenants_in_a_group():
    """Tenants of one prefix-cache group get the group's salt; a tenant in none gets no
    kwarg at all (the backend salts with its name; ScriptedBackend, which has no such kwarg,
    keeps serving them, as every other test here shows)."""
    tenants = [
        {"name": "x", "api_key": "kx", "prefix_cache_group": "team"},
        {"name": "y", "api_key": "ky", "prefix_cache_group": "team"},
        {"name": "z", "api_key": "kz"},
    ]
    loop = ServerLoop()
    try:
        backend = SaltRecordingBackend()
        url = loop.serve(create_app(backend, {"tenants": tenants, "admin_api_key": "adm"}))
        with httpx.Client(base_url=url, timeout=10) as c:
            for key in ("kx", "ky", "kz"):
                r = c.post(
                    "/v1/completions", json=comp(), headers={"Authorization": f"Bearer {key}"}
                )
                assert r.status_code == 200, r.text
            view = c.get("/admin/tenants", headers={"Authorization": "Bearer adm"}).json()
    finally:
        loop.close()
    assert backend.salts == {
        "x": (True, "group:team"),
        "y": (True, "group:team"),
        "z": (False, None),
    }
    groups = {t["name"]: t["prefix_cache_group"] for t in view["data"]}
    assert groups == {"x": "team", "y": "team", "z": None}  # keyed tenants: no anonymous one


# ---- access: keys, anonymous, admin; a refused PATCH undone -----------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@contextlib.contextmanager
def serving(config, clock=time.monotonic):
    loop = ServerLoop()
    backend = ScriptedBackend()
    try:
        app = create_app(backend, config, clock=clock)
        with httpx.Client(base_url=loop.serve(app), timeout=30) as c:
            yield c, backend, app
    finally:
        loop.close()


NO_KEY = ({}, {"Authorization": "Bearer EMPTY"}, {"Authorization": "Bearer none"})


def test_configured_keys_mean_every_request_needs_one():
    with serving({"tenants": TENANTS}) as (c, backend, app):  # allow_anonymous not given
        for headers in NO_KEY:
            for method, path in [("POST", "/v1/completions"), ("GET", "/v1/models")]:
                r = c.request(method, path, json=comp(), headers=headers)
                assert r.status_code == 401, (path, headers)
                assert r.json()["error"]["type"] == "authentication_error"
        assert backend.calls == []  # nothing reached the model
        assert "default" not in app.state.registry.tenants
        r = c.post("/v1/completions", json=comp(), headers={"Authorization": "Bearer kb"})
        assert r.status_code == 200 and backend.calls[-1]["tenant"] == "b"


def test_no_tenants_configured_serves_anyone_as_the_default_tenant():
    with serving(None) as (c, backend, _):
        for headers in NO_KEY:
            assert c.post("/v1/completions", json=comp(), headers=headers).status_code == 200
        assert {call["tenant"] for call in backend.calls} == {"default"}


def test_explicit_anonymous_access_beside_keys_works_and_warns_at_start(caplog):
    with caplog.at_level(logging.WARNING, logger="fairbatch.api"):
        with serving({"tenants": TENANTS, "allow_anonymous": True}) as (c, backend, _):
            assert c.post("/v1/completions", json=comp()).status_code == 200
            assert backend.calls[-1]["tenant"] == "default"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("allow_anonymous is true" in w and "a, b" in w for w in warnings), warnings
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fairbatch.api"):
        with serving({"tenants": TENANTS, "allow_anonymous": False}):
            pass
    assert not [r for r in caplog.records if "allow_anonymous" in r.getMessage()]


def test_admin_routes_are_off_without_an_admin_key():
    with serving({"tenants": TENANTS}) as (c, backend, _):
        for headers in ({}, {"Authorization": "Bearer ka"}, {"Authorization": "Bearer adm"}):
            for method, path in [
                ("GET", "/admin/tenants"),
                ("GET", "/admin/stats"),
                ("PATCH", "/admin/tenants/a"),
            ]:
                r = c.request(method, path, json={"weight": 9}, headers=headers)
                assert r.status_code == 403 and r.json()["error"]["code"] == "admin_disabled"
        assert all(u[1] == 2.0 for u in backend.tenant_updates if u[0] == "a")  # never changed


def test_a_refused_patch_restores_every_field_and_the_quota_debt():
    clock = FakeClock()
    tenants = [{"name": "q", "api_key": "kq", "weight": 2, "priority": 1,
                "tokens_per_minute": 61, "max_requests": 3}]  # fmt: skip
    admin = {"Authorization": "Bearer adm"}
    with serving({"tenants": tenants, "admin_api_key": "adm"}, clock) as (c, backend, app):
        q = {"Authorization": "Bearer kq"}
        # Each request charges its prompt and 3 completion tokens; the clock stands still, so
        # the bucket only drains, and the last one admitted (at a level > 0) leaves a debt, as
        # 61 is prime.
        codes = [c.post("/v1/completions", json=comp(), headers=q).status_code for _ in range(40)]
        assert 200 in codes and codes == sorted(codes) and codes[-1] == 429  # 200s, then 429s
        state = app.state.registry.tenants["q"]
        debt = state.bucket.level(clock())
        assert debt < 0
        over = c.post("/v1/completions", json=comp(), headers=q)
        assert over.status_code == 429 and over.json()["error"]["code"] == "quota_exceeded"
        retry_after = over.headers["retry-after"]
        settings = ("weight", "priority", "tokens_per_minute", "max_requests", "tokens_charged")

        def shown() -> dict:
            view = c.get("/admin/tenants", headers=admin).json()["data"][0]
            return {k: view[k] for k in settings}

        before = shown()
        configured = {"weight": 2.0, "priority": 1, "tokens_per_minute": 61.0, "max_requests": 3}
        assert before == {**configured, "tokens_charged": before["tokens_charged"]}
        backend.refuse_updates = True
        for body in (
            {"weight": 7, "priority": 5, "max_requests": 9, "tokens_per_minute": None},
            {"tokens_per_minute": 6000},
            {"max_requests": None},
        ):
            r = c.patch("/admin/tenants/q", json=body, headers=admin)
            assert r.status_code == 502, body
            assert shown() == before
            assert state.bucket.level(clock()) == debt  # the debt is kept, not erased
            again = c.post("/v1/completions", json=comp(), headers=q)
            assert again.status_code == 429 and again.headers["retry-after"] == retry_after
        # Time refills the restored bucket at the old rate (61/60 token/s): the debt is gone
        # before -debt + 1 seconds, and the tenant is admitted again.
        clock.t += -debt + 1
        assert c.post("/v1/completions", json=comp(), headers=q).status_code == 200
        backend.refuse_updates = False
        r = c.patch("/admin/tenants/q", json={"max_requests": None}, headers=admin)
        assert r.status_code == 200 and r.json()["max_requests"] is None  # back to the default
        r = c.patch("/admin/tenants/q", json={"weight": None}, headers=admin)
        assert r.status_code == 400 and "weight cannot be null" in r.json()["error"]["message"]
