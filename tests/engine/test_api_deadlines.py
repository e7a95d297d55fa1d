"""Deadlines through the OpenAI API (the official client): `timeout` and `max_queue_time_s`.

Past its deadline a request ends with finish_reason "timeout": streamed, as a last chunk after
the tokens it produced; not streamed, as the partial completion (HTTP 200), or a 408 when it
produced nothing. Tenants' defaults apply to requests that set none; bad values are 400s.
"""

from __future__ import annotations

import asyncio
import threading

import openai
import pytest
from loopback import ServerLoop
from pydantic import ValidationError

from fairbatch.deployments.api.backend import LocalBackend, create_app
from fairbatch.deployments.api.config import TenantConfig
from fairbatch.engine.llm import build_engine

MODEL = "fairbatch-tiny"
LONG = 400  # tokens: ~1 s of the tiny model on a CPU, far longer than the deadlines here


@pytest.fixture(scope="module")
def url():
    loop = ServerLoop()
    # one seat: a second request waits in the queue while the first runs
    backend = LocalBackend(build_engine("tiny", num_gpu_blocks=128, max_num_seqs=1))
    config = {
        "tenants": [
            {"name": "t", "api_key": "key-t"},
            {"name": "d", "api_key": "key-d", "default_timeout_s": 0.15},
        ],
        "limits": {"max_model_len": 1024},
    }
    yield loop.serve(create_app(backend, config))
    loop.run(backend.shutdown())
    loop.close()


def client(url: str, key: str = "key-t") -> openai.OpenAI:
    # max_retries=0: the client retries a 408 by default
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def long_body(**extra) -> dict:
    return dict(
        model=MODEL, prompt="hello", max_tokens=LONG, extra_body={"ignore_eos": True, **extra}
    )


def test_a_stream_past_its_timeout_ends_with_a_timeout_chunk_after_its_tokens(url):
    stream = client(url).completions.create(stream=True, **long_body(timeout=0.15))
    chunks = list(stream)
    reasons = [c.choices[0].finish_reason for c in chunks]
    assert reasons[-1] == "timeout" and set(reasons[:-1]) <= {None}
    text = "".join(c.choices[0].text for c in chunks)
    assert text  # it produced tokens before its deadline


def test_a_completion_past_its_timeout_is_the_partial_text_with_status_200(url):
    out = client(url).completions.create(**long_body(timeout=0.15))
    assert out.choices[0].finish_reason == "timeout"
    assert 0 < out.usage.completion_tokens < LONG
    chat = client(url).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=LONG,
        extra_body={"ignore_eos": True, "timeout": 0.15},
    )
    assert chat.choices[0].finish_reason == "timeout"
    assert 0 < chat.usage.completion_tokens < LONG


def test_the_tenants_default_timeout_applies_and_a_request_may_set_its_own(url):
    out = client(url, "key-d").completions.create(**long_body())
    assert out.choices[0].finish_reason == "timeout"
    out = client(url, "key-d").completions.create(**{**long_body(timeout=60.0), "max_tokens": 4})
    assert out.choices[0].finish_reason == "length"


def test_nothing_produced_before_the_queue_deadline_is_a_408(url):
    first_token = threading.Event()
    done: list = []

    def occupy() -> None:  # holds the only seat for about a second
        for chunk in client(url).completions.create(stream=True, **long_body()):
            first_token.set()
            done.append(chunk.choices[0].finish_reason)

    thread = threading.Thread(target=occupy)
    thread.start()
    assert first_token.wait(30)
    with pytest.raises(openai.APIStatusError) as err:
        client(url).completions.create(**long_body(max_queue_time_s=0.05))
    assert err.value.status_code == 408
    assert err.value.body["code"] == "request_timeout"
    stream = client(url).completions.create(stream=True, **long_body(max_queue_time_s=0.05))
    chunks = list(stream)  # streamed: HTTP 200 already, the last chunk says why it ended
    assert [c.choices[0].finish_reason for c in chunks] == ["timeout"]
    thread.join(60)
    assert done[-1] == "length"  # the running request was not disturbed


@pytest.mark.parametrize(
    "field, value",
    [
        ("timeout", 0),
        ("timeout", -1.0),
        ("timeout", "1"),
        ("timeout", 1e9),
        ("max_queue_time_s", 0.0),
        ("max_queue_time_s", True),
    ],
)
def test_bad_deadlines_are_400s_naming_the_field(url, field, value):
    with pytest.raises(openai.BadRequestError) as err:
        client(url).completions.create(model=MODEL, prompt="x", extra_body={field: value})
    assert field in err.value.body["message"]


@pytest.mark.parametrize("field", ["default_timeout_s", "max_queue_time_s"])
def test_bad_tenant_deadlines_are_refused_in_the_config(field):
    with pytest.raises(ValidationError, match=field):
        TenantConfig(name="x", **{field: 0})


def test_edf_is_a_policy_kwarg_of_llm_the_local_server_and_the_serve_app():
    from fairbatch.benchmarks.serve_bench import local_config
    from fairbatch.benchmarks.serve_workload import TenantPlan
    from fairbatch.deployments.api.config import ConfigError, parse_config
    from fairbatch.deployments.serve.app import parse_app_args
    from fairbatch.engine.llm import LLM

    edf = {"order_within_tenant": "edf"}
    llm = LLM("tiny", policy="weighted_fair", policy_kwargs=edf, num_gpu_blocks=16)
    assert llm.engine.scheduler.policy.order_within_tenant == "edf"
    # the local server of `fairbatch bench serve`: its engine mapping is build_engine's kwargs
    engine = {"policy": "weighted_fair", "policy_kwargs": edf, "num_gpu_blocks": 16}
    cfg = parse_config(local_config([TenantPlan("a")], engine))
    backend = LocalBackend.build(cfg.model, **cfg.engine)
    try:
        assert backend.engine.engine.scheduler.policy.order_within_tenant == "edf"
    finally:
        asyncio.run(backend.shutdown())
    with pytest.raises(ValueError, match="policy / policy_kwargs: order_within_tenant"):
        build_engine("no-such-model-dir", policy_kwargs={"order_within_tenant": "sjf"})
    # the Serve app: replicas and the controller
    app = parse_app_args(
        {
            "model": "sim",
            "engine": {"policy": "weighted_fair", "policy_kwargs": edf},
            "controller": {"policy": "weighted_fair", "policy_kwargs": edf},
        }
    )
    assert app.replica_config().policy_kwargs == edf
    assert app.controller_config().policy_kwargs == edf
    with pytest.raises(ConfigError, match="order_within_tenant"):
        parse_app_args({"model": "sim", "engine": {"policy_kwargs": {"order_within_tenant": 1}}})
