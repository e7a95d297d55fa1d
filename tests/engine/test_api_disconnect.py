"""A client that leaves mid-request, step by step: the request's KV blocks are free no later
than one engine step after the server notices, and every counter stays right.

One tiny engine (LocalBackend, weighted fair policy) paced to ~20 ms a step, so a long
request is still running when the client goes. Two probes, neither changing behaviour:
* the backend's stream records the engine's step count and the request's computed tokens
  when the API closes or cancels it (the server noticed the client was gone);
* `EngineCore.abort` records, on the engine thread, the step count, the tokens computed and
  whether the request and its blocks are gone, the moment the abort ran.

Every wait is bounded; nothing is asserted on time, only on steps and counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import time

import httpx
import pytest
from loopback import ServerLoop

from fairbatch.deployments.api.backend import LocalBackend, create_app
from fairbatch.engine.async_engine import AsyncEngine
from fairbatch.engine.llm import build_engine

MODEL = "fairbatch-tiny"
KEY, ADMIN = "key-leaver", "admin-disconnect"
MAX_TOKENS = 1500  # far more than the client waits for: the request is always cut short
STEP_PAUSE_S = 0.02  # pacing after every step (what a real model's step takes, roughly)


class ProbedBackend(LocalBackend):
    """LocalBackend plus the two probes above."""

    def __init__(self, engine: AsyncEngine) -> None:
        super().__init__(engine)
        self.noticed: dict[str, dict] = {}  # request id -> state when the API closed the stream
        self.aborted: dict[str, dict] = {}  # request id -> state right after the abort ran
        core = self.engine.engine
        abort = core.abort

        def probed_abort(rid: str) -> bool:  # on the engine thread, between steps
            request = core.scheduler.requests.get(rid)
            computed = None if request is None else len(request.output_token_ids)
            held = core.scheduler.kv.num_free_blocks < core.scheduler.kv.gpu_pool.num_blocks
            ok = abort(rid)
            if request is not None:  # the first abort; a second one finds nothing
                self.aborted.setdefault(
                    rid,
                    dict(
                        step=self.engine.num_steps,
                        computed=computed,
                        held_blocks=held,
                        gone=rid not in core.scheduler.requests,
                        all_free=core.scheduler.kv.all_free(),
                    ),
                )
            return ok

        core.abort = probed_abort  # type: ignore[method-assign]

    def _notice(self, rid: str) -> None:
        request = self.engine.engine.scheduler.requests.get(rid)
        self.noticed.setdefault(
            rid,
            dict(
                step=self.engine.num_steps,
                computed=None if request is None else len(request.output_token_ids),
            ),
        )

    async def generate(self, prompt_token_ids, params, *, request_id, tenant, priority=0, **kw):
        inner = super().generate(
            prompt_token_ids, params, request_id=request_id, tenant=tenant, priority=priority, **kw
        )
        finished = False
        try:
            while not finished:
                # Shielded, so a cancel (a non-streaming request's client left) reaches this
                # probe before it reaches the engine's stream and its abort.
                step = asyncio.ensure_future(inner.__anext__())
                try:
                    delta = await asyncio.shield(step)
                except StopAsyncIteration:
                    return
                except asyncio.CancelledError:
                    self._notice(request_id)
                    step.cancel()
                    with contextlib.suppress(BaseException):
                        await step
                    raise
                finished = delta.finished
                yield delta
        finally:
            if not finished:  # closed early (a stream's client left): the API noticed
                self._notice(request_id)
            await inner.aclose()


@pytest.fixture(scope="module")
def served():
    loop = ServerLoop()
    core = build_engine("tiny", num_gpu_blocks=256, policy="weighted_fair", max_num_seqs=8)
    backend = ProbedBackend(AsyncEngine(core, step_hook=lambda: time.sleep(STEP_PAUSE_S)))
    config = {
        "tenants": [{"name": "leaver", "api_key": KEY}],
        "admin_api_key": ADMIN,
        "allow_anonymous": False,
    }
    app = create_app(backend, config)
    url = loop.serve(app)
    yield loop, backend, app, url
    loop.run(backend.shutdown())
    loop.close()


def wait_for(pred, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (got := pred()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
    return got


def send(url: str, body: dict, path: str = "/v1/completions") -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    data = json.dumps(body).encode()
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def tokens_in(buf: bytes) -> int:
    """Completion tokens in the SSE chunks received (each chunk's logprobs list its tokens)."""
    n = 0
    for m in re.finditer(rb"data: (\{[^\n]*\})", buf):
        choices = json.loads(m.group(1))["choices"]
        if choices and choices[0].get("logprobs"):
            n += len(choices[0]["logprobs"]["tokens"])
    return n


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_frees_kv_within_one_step_and_counters_stay_right(served, stream):
    loop, backend, app, url = served
    core = backend.engine.engine
    policy = core.scheduler.policy
    reg = app.state.registry
    tenant = reg.tenants["leaver"]
    service_before = loop.run(backend.engine.call(lambda: policy.service().get("leaver", 0.0)))
    charged_before = tenant.tokens_charged
    prompt = f"a client that will leave early ({'stream' if stream else 'whole'})"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    body.update(stream=stream, logprobs=0)  # logprobs: every chunk names its tokens

    sock = send(url, body)
    received = b""
    if stream:  # read until 5 tokens came, then leave
        while tokens_in(received) < 5:
            chunk = sock.recv(65536)  # bounded by the socket timeout
            assert chunk, received[-300:]
            received += chunk
    else:  # the answer comes only at the end: leave once the request has 5 tokens computed

        def computed() -> int:
            def run() -> int:
                reqs = list(core.scheduler.requests.values())
                return len(reqs[0].output_token_ids) if reqs else 0

            return loop.run(backend.engine.call(run))

        wait_for(lambda: computed() >= 5, "the request to compute 5 tokens")
    rid = next(iter(reg.requests))
    ticket = reg.requests[rid]
    sock.close()  # the client goes away

    wait_for(lambda: rid in backend.aborted, "the request to be aborted")
    noticed, aborted = backend.noticed[rid], backend.aborted[rid]
    got = tokens_in(received)
    print(f"disconnect stream={stream}: noticed {noticed}, aborted {aborted}, client got {got}")

    # KV: the blocks were held, and were free right after the abort, which ran no later than
    # one step after the server noticed.
    assert aborted["held_blocks"] and aborted["gone"] and aborted["all_free"], aborted
    assert aborted["step"] - noticed["step"] <= 1, (noticed, aborted)
    assert aborted["computed"] - noticed["computed"] <= 1, (noticed, aborted)

    # Counters. The API's own: nothing in flight, the tenant's count back to 0.
    wait_for(lambda: reg.total_in_flight == 0, "the API to release the request")
    assert tenant.in_flight == 0 and rid not in reg.requests
    # The policy charged the tokens the engine computed, no more: the prompt and every output
    # token up to the abort (at least those the client got; nowhere near max_tokens).
    computed_tokens = aborted["computed"]
    print(f"  api took {ticket.completion_tokens}, prompt {ticket.prompt_tokens}")
    assert got <= ticket.completion_tokens <= computed_tokens < MAX_TOKENS // 10
    if stream:
        assert got >= 5
    service = loop.run(backend.engine.call(lambda: policy.service().get("leaver", 0.0)))
    expected = policy.input_weight * ticket.prompt_tokens + policy.output_weight * computed_tokens
    assert service - service_before == pytest.approx(expected), (ticket, aborted)
    # The ingress quota ledger charged the prompt and the tokens the API took from the engine.
    assert tenant.tokens_charged - charged_before == ticket.prompt_tokens + ticket.completion_tokens
    # And the engine, as the admin sees it: nothing running, nothing in flight.
    stats = httpx.get(f"{url}/admin/stats", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    assert stats["engine"]["running"] == 0 and stats["engine"]["waiting"] == 0
    assert stats["in_flight"] == 0
    loop.run(backend.engine.call(core.check_integrity))


def test_a_responses_stream_whose_client_leaves_frees_kv_within_one_step(served):
    """`/v1/responses` streams through the same run: a client that leaves after 3 text deltas
    has its request aborted within one step of the server noticing, its blocks free."""
    loop, backend, app, url = served
    reg = app.state.registry
    body = {"model": MODEL, "input": "a responses client that will leave early",
            "max_output_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}  # fmt: skip
    sock = send(url, body, "/v1/responses")
    received = b""
    while received.count(b"event: response.output_text.delta") < 3:
        chunk = sock.recv(65536)  # bounded by the socket timeout
        assert chunk, received[-300:]
        received += chunk
    rid = next(iter(reg.requests))
    sock.close()

    wait_for(lambda: rid in backend.aborted, "the request to be aborted")
    noticed, aborted = backend.noticed[rid], backend.aborted[rid]
    assert aborted["held_blocks"] and aborted["gone"] and aborted["all_free"], aborted
    assert aborted["step"] - noticed["step"] <= 1, (noticed, aborted)
    assert aborted["computed"] < MAX_TOKENS // 10
    wait_for(lambda: reg.total_in_flight == 0, "the API to release the request")
    loop.run(backend.engine.call(backend.engine.engine.check_integrity))
