"""Bad input to the OpenAI API: the right 4xx in OpenAI's error shape, and a healthy server after.

Includes a hypothesis fuzz test of request bodies: never a 5xx, never a crash.
"""

from __future__ import annotations

import json
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loopback import ServerLoop

from fairbatch.deployments.api.backend import LocalBackend, create_app
from fairbatch.engine.llm import build_engine

MODEL = "fairbatch-tiny"
KEY = "tenant-key"
MAX_LEN = 64
BODY_LIMIT = 4096


@pytest.fixture(scope="module")
def server():
    loop = ServerLoop()
    backend = LocalBackend(build_engine("tiny", num_gpu_blocks=64))
    config = {
        "tenants": [{"name": "t", "api_key": KEY}],
        "allow_anonymous": False,
        "limits": {"max_model_len": MAX_LEN, "max_body_bytes": BODY_LIMIT, "default_max_tokens": 8},
    }
    app = create_app(backend, config)

    @app.get("/probe/{n}")  # a FastAPI-validated route: exercises the validation handler
    async def probe(n: int) -> dict:
        return {"n": n}

    url = loop.serve(app)
    with httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c, app, backend, loop
    loop.run(backend.shutdown())
    loop.close()


def assert_openai_error(r: httpx.Response, status: int, param: str | None = "?") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param != "?":
        assert err["param"] == param, err
    return err


def assert_healthy(c: httpx.Client) -> None:
    assert c.get("/health").json() == {"status": "ok"}
    ok = c.post("/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 1})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1


def chat(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}


def comp(**kw):
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **kw}


LONG_PROMPT = " ".join(["word"] * 200)  # far over MAX_LEN tokens, far under BODY_LIMIT bytes

BAD_BODIES = [
    # (id, path, body (dict or raw bytes), status, param)
    ("malformed-json", "completions", b'{"model": "x", ', 400, None),
    ("not-an-object", "completions", b"[1, 2]", 400, None),
    ("nan", "completions", b'{"model": "fairbatch-tiny", "prompt": "a", "top_p": NaN}', 400, None),
    ("empty-body", "chat/completions", b"", 400, None),
    (
        "invalid-utf8",
        "completions",
        b'{"model": "fairbatch-tiny", "prompt": "\xff\xfe"}',
        400,
        None,
    ),
    (
        "lone-surrogate",
        "completions",
        b'{"model": "fairbatch-tiny", "prompt": "\\ud800"}',
        400,
        None,
    ),
    ("missing-model", "completions", {"prompt": "a"}, 400, "model"),
    ("missing-prompt", "completions", {"model": MODEL}, 400, "prompt"),
    ("missing-messages", "chat/completions", {"model": MODEL}, 400, "messages"),
    ("model-wrong-type", "completions", comp(model=3), 400, "model"),
    ("max-tokens-string", "completions", comp(max_tokens="5"), 400, "max_tokens"),
    ("stream-int", "completions", comp(stream=1), 400, "stream"),
    ("temperature-high", "completions", comp(temperature=2.5), 400, "temperature"),
    ("temperature-negative", "chat/completions", chat(temperature=-0.1), 400, "temperature"),
    ("top-p-zero", "completions", comp(top_p=0), 400, "top_p"),
    ("top-p-high", "chat/completions", chat(top_p=1.5), 400, "top_p"),
    ("top-k-bad", "completions", comp(top_k=-2), 400, "top_k"),
    ("max-tokens-zero", "completions", comp(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-negative", "chat/completions", chat(max_tokens=-5), 400, "max_tokens"),
    (
        "max-completion-tokens-0",
        "chat/completions",
        chat(max_completion_tokens=0),
        400,
        "max_completion_tokens",
    ),
    ("n-over-16", "completions", comp(n=17), 400, "n"),
    ("n-zero", "chat/completions", chat(n=0), 400, "n"),
    ("logprobs-high", "completions", comp(logprobs=21), 400, "logprobs"),
    ("logprobs-negative", "completions", comp(logprobs=-1), 400, "logprobs"),
    (
        "top-logprobs-high",
        "chat/completions",
        chat(logprobs=True, top_logprobs=99),
        400,
        "top_logprobs",
    ),
    ("top-logprobs-alone", "chat/completions", chat(top_logprobs=2), 400, "top_logprobs"),
    ("penalty-high", "completions", comp(presence_penalty=3), 400, "presence_penalty"),
    ("seed-huge", "completions", comp(seed=2**70), 400, "seed"),
    ("empty-prompt", "completions", comp(prompt=""), 400, "prompt"),
    ("empty-prompt-list", "completions", comp(prompt=[]), 400, "prompt"),
    ("batch-of-bad", "completions", comp(prompt=["a", [1, "x"]]), 400, "prompt"),
    ("batch-empty-one", "completions", comp(prompt=["a", ""]), 400, "prompt"),
    ("bad-token-id", "completions", comp(prompt=[1, 10**9]), 400, "prompt"),
    ("prompt-dict", "completions", comp(prompt={"a": 1}), 400, "prompt"),
    ("long-prompt", "completions", comp(prompt=LONG_PROMPT), 400, "prompt"),
    (
        "prompt-plus-max-tokens",
        "completions",
        comp(prompt="hi there", max_tokens=62),
        400,
        "max_tokens",
    ),
    (
        "long-chat",
        "chat/completions",
        chat(messages=[{"role": "user", "content": LONG_PROMPT}]),
        400,
        "prompt",
    ),  # fmt: skip
    ("empty-messages", "chat/completions", chat(messages=[]), 400, "messages"),
    (
        "unknown-role",
        "chat/completions",
        chat(messages=[{"role": "wizard", "content": "x"}]),
        400,
        "messages.0.role",
    ),  # fmt: skip
    ("message-not-dict", "chat/completions", chat(messages=["hi"]), 400, "messages.0"),
    (
        "user-without-content",
        "chat/completions",
        chat(messages=[{"role": "user"}]),
        400,
        "messages.0.content",
    ),
    (
        "image-part",
        "chat/completions",
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]),
        400,
        "messages.0.content",
    ),  # fmt: skip
    ("stop-empty", "completions", comp(stop=""), 400, "stop"),
    ("stop-too-many", "completions", comp(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    ("stop-wrong-type", "completions", comp(stop=[1]), 400, "stop"),
    ("stream-options-no-stream", "completions", comp(stream_options={}), 400, "stream_options"),
    ("max-tokens-0", "completions", comp(max_tokens=0), 400, "max_tokens"),
    ("unknown-field", "completions", comp(frobnicate=1), 400, "frobnicate"),
    ("tool-choice", "chat/completions", chat(tool_choice="auto"), 400, "tool_choice"),
    ("bias-key", "completions", comp(logit_bias={"x": 1}), 400, "logit_bias"),
    ("bias-key-spaced", "completions", comp(logit_bias={" 5 ": 1}), 400, "logit_bias"),
    ("bias-key-signed", "completions", comp(logit_bias={"+5": 1}), 400, "logit_bias"),
    ("bias-key-underscore", "completions", comp(logit_bias={"5_0": 1}), 400, "logit_bias"),
    ("bias-oov", "completions", comp(logit_bias={"99999999": 1}), 400, "logit_bias"),
    ("bias-type", "completions", comp(logit_bias={"1": "a"}), 400, "logit_bias.1"),
    ("tools", "chat/completions", chat(tools=[{"type": "function"}]), 400, "tools.0"),
]


@pytest.mark.parametrize("path,body,status,param", [b[1:] for b in BAD_BODIES],
                         ids=[b[0] for b in BAD_BODIES])  # fmt: skip
def test_bad_request_bodies(server, path, body, status, param):
    c = server[0]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = c.post(f"/v1/{path}", content=content, headers={"Content-Type": "application/json"})
    assert_openai_error(r, status, param)
    assert_healthy(c)


def test_unknown_model_is_404(server):
    c = server[0]
    err = assert_openai_error(c.post("/v1/completions", json=comp(model="gpt-9")), 404, "model")
    assert err["code"] == "model_not_found"
    assert_openai_error(c.post("/v1/chat/completions", json=chat(model="gpt-9")), 404, "model")
    assert_healthy(c)


def test_context_errors_say_so(server):
    c = server[0]
    err = assert_openai_error(c.post("/v1/completions", json=comp(prompt=LONG_PROMPT)), 400)
    assert err["code"] == "context_length_exceeded" and str(MAX_LEN) in err["message"]


def test_oversized_bodies_are_413_before_parsing(server):
    c = server[0]
    big = json.dumps(comp(prompt="x" * (BODY_LIMIT * 4))).encode()
    assert_openai_error(c.post("/v1/completions", content=big), 413)

    def chunked():  # no Content-Length: the limit is enforced while reading
        for _ in range(8):
            yield b"x" * 1024

    assert_openai_error(c.post("/v1/completions", content=chunked()), 413)
    junk = b"{" * (BODY_LIMIT * 2)  # would be a parse bomb, never parsed
    assert_openai_error(c.post("/v1/chat/completions", content=junk), 413)
    assert_healthy(c)


def test_auth_errors(server):
    c = server[0]
    no_key = httpx.post(str(c.base_url).rstrip("/") + "/v1/completions", json=comp())
    assert_openai_error(no_key, 401)
    bad = c.post("/v1/completions", json=comp(), headers={"Authorization": "Bearer nope"})
    assert assert_openai_error(bad, 401)["type"] == "authentication_error"
    assert_healthy(c)


def test_unknown_routes_and_framework_validation_use_the_openai_shape(server):
    c = server[0]
    assert_openai_error(c.get("/v1/nothing-here"), 404)
    assert_openai_error(c.get("/v1/completions"), 405)
    assert_openai_error(c.get("/probe/not-an-int"), 400, "path.n")
    assert c.get("/probe/3").json() == {"n": 3}


# ---- fuzz ------------------------------------------------------------------------------------

json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
json_value = st.recursive(
    json_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
small_int = st.integers(min_value=-3, max_value=80)
# Valid values for each field: most fuzzed bodies take these, then one or two fields go wild.
SANE = {
    "max_tokens": st.integers(1, 8),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "stop": st.one_of(st.text(min_size=1, max_size=4), st.lists(st.text(min_size=1), max_size=4)),
    "stream": st.booleans(),
    "ignore_eos": st.booleans(),
    "n": st.just(1),
    "user": st.text(max_size=10),
}
WILD = {
    "model": json_value,
    "prompt": st.one_of(st.lists(st.integers(-5, 3000), max_size=8), json_value),
    "messages": json_value,
    "max_tokens": st.one_of(small_int, json_value),
    "max_completion_tokens": small_int,
    "temperature": st.one_of(st.floats(-1, 3), json_value),
    "top_p": st.floats(-0.5, 1.5),
    "top_k": small_int,
    "seed": st.integers(-(2**70), 2**70),
    "presence_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(-1, 12),
    "stop": st.one_of(st.lists(st.text(max_size=5), max_size=6), json_value),
    "n": st.one_of(small_int, json_value),
    "logprobs": st.one_of(small_int, st.booleans(), json_value),
    "top_logprobs": small_int,
    "stream": json_value,
    "stream_options": st.one_of(
        st.fixed_dictionaries({"include_usage": st.booleans()}), json_value
    ),
    "echo": st.booleans(),
    "response_format": json_value,
}
sane = st.fixed_dictionaries(
    {
        "model": st.just(MODEL),
        "prompt": st.text(min_size=1, max_size=40),
        "messages": st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.sampled_from(["user", "system", "assistant", "developer"]),
                    "content": st.text(max_size=15),
                }
            ),
            min_size=1,
            max_size=2,
        ),
    },
    optional=SANE,
)
wild = st.dictionaries(
    st.sampled_from(sorted(WILD)), st.just(None), min_size=1, max_size=2
).flatmap(lambda keys: st.fixed_dictionaries({k: WILD[k] for k in keys}))
junk = st.dictionaries(st.text(max_size=8), json_value, max_size=2)
bodies = st.builds(
    lambda j, base, w, go_wild: {**j, **base, **(w if go_wild else {})},
    junk,
    sane,
    wild,
    st.booleans(),
)
SEEN: Counter = Counter()  # status codes the fuzz test got


@settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(path=st.sampled_from(["completions", "chat/completions"]), body=bodies)
def test_fuzzed_bodies_never_5xx(server, path, body):
    c = server[0]
    # the other endpoint's input field would be an unsupported field (400) every time
    body.pop("messages" if path == "completions" else "prompt", None)
    r = c.post(f"/v1/{path}", json=body)
    SEEN[r.status_code] += 1
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    elif body.get("stream") is True:
        assert r.text.rstrip().endswith("data: [DONE]")
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_server_healthy_and_idle_after_fuzz(server):
    c, app, backend, loop = server
    print("fuzz status codes:", dict(SEEN))
    # The fuzz reached both the model and the validators (exact counts vary with the hypothesis
    # version; each side gets well over 10 of the 100 examples).
    assert SEEN[200] >= 10 and SEEN[400] >= 10
    assert_healthy(c)
    assert app.state.registry.total_in_flight == 0
    core = backend.engine.engine
    idle = loop.run(
        backend.engine.call(lambda: not core.has_unfinished() and core.scheduler.kv.all_free())
    )
    assert idle
