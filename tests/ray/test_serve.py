"""The Serve app end to end: `serve deploy` of a YAML derived from deployments/serve_config.yaml,
the official `openai` client over loopback HTTP, the handle API from a second Serve app,
metrics on the node's metrics port, quotas, disconnects.

One Ray (2 fake GPUs, dashboard on for the `serve` CLI) and one deployment (2 tiny-Llama
replicas) for the whole module. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

openai = pytest.importorskip("openai")
ray = pytest.importorskip("ray")
from live_actors import replica_check  # noqa: E402
from loopback import (  # noqa: E402
    free_port,
    wait_app_running,
    wait_for,
    wait_healthy,
)
from lora_adapters import make_tiny_adapter  # noqa: E402
from ray import serve  # noqa: E402
from serve_actors import ingress_actors, sigkill  # noqa: E402

from fairbatch.deployments.api.config import sha256_hex  # noqa: E402
from fairbatch.deployments.serve.app import ConfigError, parse_app_args, read_args_file  # noqa: E402
from fairbatch.deployments.serve.handle_api import HandleRejected  # noqa: E402
from fairbatch.engine.tokenizer import Tokenizer  # noqa: E402

# A loaded 2-core box can take longer than Ray's 30 s to start the metrics agent.
os.environ.setdefault("RAY_agent_register_timeout_ms", "120000")
REPO = Path(__file__).resolve().parents[2]
KEYS = {"a": "sk-a", "b": "sk-b", "c": "sk-c", "q": "sk-q", "d": "sk-d", "h": "sk-h"}
WEIGHTS = {"a": 1.0, "b": 2.0, "c": 4.0}
ADMIN = "sk-admin"
MODEL = "fairbatch-tiny"
DEPLOY_TIMEOUT_S = 240


def app_args() -> dict:
    """The example config's args, with test tenants and a small cluster."""
    args = read_args_file(REPO / "deployments" / "serve_config.yaml")
    args.update(
        num_replicas=2,
        cluster_name="fbtest",
        metrics_interval_s=0.5,
        admin_api_key=ADMIN,
        allow_anonymous=True,  # the blocker streams run as the anonymous tenant
        engine={
            "num_gpu_blocks": 64,
            "num_cpu_blocks": 64,
            "max_num_seqs": 1,  # one seat per replica: queues form at the controller
            "max_num_batched_tokens": 256,
            "max_model_len": 512,
            "device": "cpu",
        },
        # fair preemption off: test_concurrent_streams_three_tenants holds both seats with
        # blocker streams on purpose, to see the queue's order when a seat frees
        controller={"local_queue": 0, "fair_preemption": False},
        tool_call_parser="hermes",  # tool_choice "auto" through `serve deploy`
        tenants=[
            *({"name": n, "api_key": KEYS[n], "weight": w} for n, w in WEIGHTS.items()),
            {"name": "q", "api_key": KEYS["q"], "tokens_per_minute": 30},
            {"name": "d", "api_key": KEYS["d"]},
            {"name": "h", "api_key": KEYS["h"]},
        ],
    )
    args.pop("admin_api_key_sha256", None)
    return args


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    http_port, dash_port, metrics_port = free_port(), free_port(), free_port()
    # as cluster.yaml starts Ray: the proxy reaches the ingress over gRPC
    saved = os.environ.get("RAY_SERVE_USE_GRPC_BY_DEFAULT")
    os.environ["RAY_SERVE_USE_GRPC_BY_DEFAULT"] = "1"
    ray.init(
        num_cpus=2,
        num_gpus=2,
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        dashboard_port=dash_port,
        _metrics_export_port=metrics_port,
        _temp_dir=os.environ["RAY_TMPDIR"],
        log_to_driver=False,
        configure_logging=False,
    )
    config = {
        "http_options": {"host": "127.0.0.1", "port": http_port},
        "applications": [
            {
                "name": "fairbatch",
                "route_prefix": "/",
                "import_path": "fairbatch.deployments.serve.app:build_app",
                "args": app_args(),
            }
        ],
    }
    # a LoRA adapter for tenant "h" (test_lora_adapter_through_the_cluster)
    args = config["applications"][0]["args"]
    args["engine"].update(max_loras=1, max_lora_rank=8)
    lora = make_tiny_adapter(tmp_path_factory.mktemp("lora") / "tiny-lora", seed=1)
    args["lora_adapters"] = [{"name": "tiny-lora", "path": lora, "tenants": ["h"]}]
    path = tmp_path_factory.mktemp("serve") / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    serve_cli = Path(sys.executable).parent / "serve"
    try:
        subprocess.run(
            [str(serve_cli), "deploy", str(path), "--address", f"http://127.0.0.1:{dash_port}"],
            check=True,
            timeout=120,
            capture_output=True,
            env=os.environ.copy(),
        )

        wait_app_running(DEPLOY_TIMEOUT_S)
        base = f"http://127.0.0.1:{http_port}"
        wait_healthy(base)
        yield {"base": base, "metrics_port": metrics_port, "lora": lora}
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            if saved is None:
                os.environ.pop("RAY_SERVE_USE_GRPC_BY_DEFAULT", None)
            else:
                os.environ["RAY_SERVE_USE_GRPC_BY_DEFAULT"] = saved


def client(served, tenant: str | None = "a", **kw) -> openai.OpenAI:
    key = KEYS[tenant] if tenant else "EMPTY"
    return openai.OpenAI(base_url=served["base"] + "/v1", api_key=key, max_retries=0, **kw)


def replicas() -> dict:
    handle = serve.get_app_handle("fairbatch")
    return handle.replica_handles.remote().result(timeout_s=30)


def wait_pools_free(timeout_s: float = 60) -> None:
    for rid, h in replicas().items():

        def free(h=h):
            state = replica_check(h)
            return state["all_free"] and state["requests"] == 0

        wait_for(free, timeout_s, f"{rid} to free every block")


# ---- no Ray needed ------------------------------------------------------------------------------


def test_args_are_validated_with_field_names():
    with pytest.raises(ConfigError, match="engine: unknown engine setting"):
        parse_app_args({"engine": {"max_num_seq": 4}})
    with pytest.raises(ConfigError, match=r"tenants\.0\.weight"):
        parse_app_args({"tenants": [{"name": "x", "weight": 0}]})
    with pytest.raises(ConfigError, match="num_replicas"):
        parse_app_args({"num_replicas": 0})
    with pytest.raises(ConfigError, match="set engine.max_loras"):
        parse_app_args({"lora_adapters": [{"name": "x", "path": "/p"}]})
    cfg = parse_app_args({"engine": "sim", "num_replicas": 3})
    assert cfg.model == "sim" and cfg.model_name == "fairbatch-sim" and cfg.num_replicas == 3
    example = parse_app_args({"config_file": str(REPO / "deployments" / "serve_config.yaml")})
    assert [t.name for t in example.tenants] == ["team-a", "team-b"]
    # The shipped example needs a key for every request, and its keys are not guessable words.
    assert example.allow_anonymous is False and example.anonymous_risk is None
    words = ["admin", "sk-team-a-example", "sk-team-b-example", "team-a", "team-b", "secret"]
    digests = [example.admin_api_key_sha256, *(t.api_key_sha256 for t in example.tenants)]
    assert all(d is not None and d not in map(sha256_hex, words) for d in digests)


# ---- the OpenAI client --------------------------------------------------------------------------


def test_models_list_and_auth(served):
    models = client(served).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert [m.id for m in client(served, "h").models.list().data] == [MODEL, "tiny-lora"]
    with pytest.raises(openai.AuthenticationError):
        client(served, None, default_headers={"Authorization": "Bearer nope"}).models.list()


def test_completion_usage_and_stop(served):
    tok = Tokenizer.tiny()
    prompt = "The quick brown fox jumps over the lazy dog"
    c = client(served)
    full = c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    assert full.usage.prompt_tokens == len(tok.encode(prompt))
    assert full.usage.completion_tokens == 24
    assert full.choices[0].finish_reason == "length"
    text = full.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    cut = c.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=24,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.usage.completion_tokens < 24


def test_lora_adapter_through_the_cluster(served, tmp_path):
    """The configured adapter serves tenant "h" the offline engine's tokens under it, and no
    one else; the admin API loads through the replicas' own check (a broken directory is a
    400 with their reason) and unloads."""
    from fairbatch.engine import LLM, SamplingParams
    from fairbatch.engine.sampling_params import LoRARequest

    prompt = "The quick brown fox"
    llm = LLM("tiny", max_loras=1, max_lora_rank=8)
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    (want,) = llm.generate([prompt], greedy, lora=LoRARequest("x", served["lora"]))
    (base,) = llm.generate([prompt], greedy)
    assert want.text != base.text

    def complete(tenant, model):
        return client(served, tenant).completions.create(
            model=model, prompt=prompt, max_tokens=16, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip

    got = complete("h", "tiny-lora")
    assert (got.model, got.choices[0].text) == ("tiny-lora", want.text)
    with pytest.raises(openai.PermissionDeniedError, match="may not use the LoRA adapter"):
        complete("a", "tiny-lora")
    admin = {"Authorization": f"Bearer {ADMIN}"}
    url = served["base"] + "/admin/loras"
    broken = {"name": "broken", "path": str(tmp_path / "missing")}
    r = httpx.post(url, json=broken, headers=admin, timeout=60)
    assert r.status_code == 400 and "missing" in r.json()["error"]["message"], r.text
    again = {"name": "for-a", "path": served["lora"], "tenants": ["a"]}
    assert httpx.post(url, json=again, headers=admin, timeout=60).status_code == 200
    assert complete("a", "for-a").choices[0].text == want.text
    assert httpx.delete(url + "/for-a", headers=admin, timeout=60).status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete("a", "for-a")


def test_no_access_log_line_per_request_unless_asked(served):
    """Serve's access log (a line per request in the ingress's log, and on every driver's
    console that shows worker logs) is off by default; `access_log: true` turns it on."""
    from fairbatch.deployments.serve.app import build_app

    for args, want in (({}, False), ({"access_log": True}, True)):
        logging_config = build_app(args)._bound_deployment._deployment_config.logging_config
        assert logging_config["enable_access_log"] is want
    c = client(served)
    for _ in range(3):
        c.completions.create(model=MODEL, prompt="hello", max_tokens=2)
    logs = Path(os.environ["RAY_TMPDIR"]) / "session_latest" / "logs" / "serve"
    files = list(logs.glob("replica_fairbatch_FairbatchIngress_*.log"))
    assert files, sorted(p.name for p in logs.iterdir())
    # with it on, each request leaves "... -- POST /v1/completions 200 12.3ms" there
    assert not [p for p in files if "-- POST /v1/completions" in p.read_text()]


def test_prompt_lists_echo_and_cached_tokens_through_the_cluster(served):
    """What lm-eval and LangChain's completions LLM send: a list of prompts (one choice each, in
    order), echo with prompt log-probs (engine values, the first null), max_tokens 0; and the
    prefix-cache hits of a repeated prompt in usage."""
    from fairbatch.engine import LLM, SamplingParams

    ref = LLM("tiny")
    c = client(served)
    prompts = ["one prompt", "and another one", "a third"]
    out = c.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0,
                               extra_body={"ignore_eos": True})  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = [o.text for o in ref.generate(prompts, greedy, use_tqdm=False)]
    assert [ch.index for ch in out.choices] == [0, 1, 2]
    assert [ch.text for ch in out.choices] == want
    # n samples: the sibling follows sample 0 to its replica; greedy, so both alike
    two = c.completions.create(model=MODEL, prompt=prompts[0], n=2, max_tokens=4,
                               temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert [ch.text for ch in two.choices] == [want[0]] * 2
    assert two.usage.prompt_tokens == len(Tokenizer.tiny().encode(prompts[0]))  # once
    prompt = "score this prompt, token by token"
    scored = c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1
    ).choices[0]
    engine = ref.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=1), False)[0]
    assert scored.text == prompt
    assert scored.logprobs.token_logprobs[0] is None
    assert scored.logprobs.token_logprobs[1:] == pytest.approx(
        [e[0][1] for e in engine.prompt_logprobs[1:]], abs=1e-4
    )
    long = " ".join(["a prompt long enough to fill whole blocks"] * 6)
    n = len(Tokenizer.tiny().encode(long))
    cached = [
        c.completions.create(model=MODEL, prompt=long, max_tokens=1).usage.prompt_tokens_details
        for _ in range(3)
    ]
    # 3 sends on 2 replicas: one replica saw it before; prefix affinity sends it there
    assert cached[0].cached_tokens == 0
    assert max(x.cached_tokens for x in cached[1:]) == (n - 1) // 16 * 16


def test_chat_and_streaming_chat_agree(served):
    c = client(served, "b")
    messages = [{"role": "user", "content": "Say something about fair scheduling."}]
    kw = dict(model=MODEL, messages=messages, max_tokens=16, temperature=0.8, seed=7)
    whole = c.chat.completions.create(**kw)
    chunks = list(
        c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens > 0


def test_responses_api_through_the_cluster(served):
    """`/v1/responses` on the Ray Serve app: its reply (whole and streamed) is the same greedy
    chat request's."""
    c = client(served, "b")
    text = "Say something about fair scheduling."
    chat = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=12, temperature=0
    )
    kw = dict(model=MODEL, input=text, max_output_tokens=12, temperature=0)
    whole = c.responses.create(**kw)
    with c.responses.stream(**kw) as stream:
        events = list(stream)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert whole.output_text == deltas == chat.choices[0].message.content
    assert whole.usage.output_tokens == chat.usage.completion_tokens == 12
    assert events[-1].type == "response.incomplete"  # it ran to max_output_tokens


def test_tool_choice_auto_through_the_deployed_config(served):
    """The Serve config's tool_call_parser reaches the ingress: "auto" (the default with tools)
    is served, and the tiny model, which writes no call, answers what it answers without tools
    (the same greedy text)."""
    c = client(served, "b")
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    kw = dict(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    auto = c.chat.completions.create(tools=[weather], **kw).choices[0]
    plain = c.chat.completions.create(tools=[weather], tool_choice="none", **kw).choices[0]
    assert auto.message.content == plain.message.content and not auto.message.tool_calls
    assert auto.finish_reason == plain.finish_reason


def test_logprobs_through_the_cluster(served):
    """The replicas' sampler records reach the client: per token, the sampled token's logprob
    and the top-N, whole and streamed, completion and chat shapes."""
    c = client(served)
    kw = dict(model=MODEL, prompt="log probs", max_tokens=5, temperature=0, logprobs=2)
    r = c.completions.create(**kw, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for sampled, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 2 and sampled <= 0
        assert sampled >= max(top.values()) - 1e-4  # greedy: the sampled token is the top-1
    chunks = list(c.completions.create(**kw, stream=True, extra_body={"ignore_eos": True}))
    streamed = [t for ch in chunks if ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    assert streamed == lp.tokens
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
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)


def test_concurrent_streams_three_tenants(served):
    """Two long "blocker" streams hold both seats (one per replica, no local queue) while 9
    streams queue at the controller, submitted a, a, a, b, b, b, c, c, c. Weighted fair order
    (weights 1:2:4) must serve all of c before the last of a; arrival order would not."""
    finished: list[str] = []
    started = 0

    async def one(tenant: str | None, i: int, max_tokens: int) -> tuple[str, int, str]:
        nonlocal started
        key = KEYS[tenant] if tenant else "EMPTY"
        c = openai.AsyncOpenAI(base_url=served["base"] + "/v1", api_key=key, max_retries=0)
        stream = await c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"stream {i} of {tenant}"}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, usage = "", None
        async for ch in stream:
            if ch.choices and ch.choices[0].delta.content:
                if not text and tenant is None:
                    started += 1
                text += ch.choices[0].delta.content
            if ch.usage is not None:
                usage = ch.usage
        await c.close()
        finished.append(tenant or "blocker")
        return tenant or "blocker", usage.completion_tokens, text

    handle = serve.get_app_handle("fairbatch")

    def queued() -> int:  # requests waiting in the controller's global queue
        return handle.cluster_stats.remote().result(timeout_s=30)["controller"]["queued"]

    async def run():
        blockers = [asyncio.create_task(one(None, i, 400)) for i in range(2)]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while started < 2:  # both seats taken
            assert loop.time() < deadline, "the blocker streams did not start"
            await asyncio.sleep(0.02)
        jobs = [asyncio.create_task(one(t, i, 16)) for t in WEIGHTS for i in range(3)]
        # The order is decided when a seat frees: all 9 must be queued by then (otherwise the
        # first arrivals are simply the only backlogged tenant).
        while await asyncio.to_thread(queued) < 9:
            assert "blocker" not in finished, "a seat freed before the 9 streams were queued"
            assert loop.time() < deadline + 30, "the 9 streams did not reach the controller"
            await asyncio.sleep(0.05)
        out = await asyncio.wait_for(asyncio.gather(*jobs), timeout=150)
        await asyncio.wait_for(asyncio.gather(*blockers), timeout=60)
        return out

    results = asyncio.run(run())
    assert sorted(t for t, _, _ in results) == sorted(list(WEIGHTS) * 3)
    assert all(n == 16 for _, n, _ in results)
    order = [t for t in finished if t != "blocker"]
    last = {t: max(i for i, x in enumerate(order) if x == t) for t in WEIGHTS}
    assert last["c"] < last["a"], order  # arrival order would finish every a first
    mean = {t: sum(i for i, x in enumerate(order) if x == t) / 3 for t in WEIGHTS}
    assert mean["c"] < mean["a"], order
    ctrl_tenants = handle.cluster_tenants.remote().result(timeout_s=30)
    for t, w in WEIGHTS.items():
        assert ctrl_tenants[t][0] == w  # the weights reached the global queue's policy
    wait_pools_free()


def test_admin_changes_weight_at_run_time(served):
    r = httpx.patch(
        served["base"] + "/admin/tenants/a",
        json={"weight": 3},
        headers={"Authorization": f"Bearer {ADMIN}"},
        timeout=30,
    )
    assert r.status_code == 200 and r.json()["weight"] == 3
    handle = serve.get_app_handle("fairbatch")
    assert handle.cluster_tenants.remote().result(timeout_s=30)["a"][0] == 3
    r = httpx.patch(served["base"] + "/admin/tenants/a", json={"weight": 1}, timeout=30)
    assert r.status_code == 401


def test_quota_429_with_retry_after(served):
    c = client(served, "q")
    c.completions.create(model=MODEL, prompt="spend the whole quota", max_tokens=32)
    with pytest.raises(openai.RateLimitError) as err:
        c.completions.create(model=MODEL, prompt="one more", max_tokens=4)
    assert int(err.value.response.headers["Retry-After"]) >= 1
    assert err.value.response.json()["error"]["code"] == "quota_exceeded"
    handle = serve.get_app_handle("fairbatch")
    with pytest.raises(HandleRejected) as rej:  # the handle API admits the same way
        handle.complete.remote({"prompt": "via handle", "tenant": "q"}).result(timeout_s=60)
    assert rej.value.status == 429 and rej.value.retry_after >= 1
    with pytest.raises(ValueError, match="unknown tenant"):
        handle.complete.remote({"prompt": "x", "tenant": "nobody"}).result(timeout_s=60)


def test_disconnect_frees_kv_blocks(served):
    max_tokens = 480  # near max_model_len (512): the abort has the longest window to land
    body = {
        "model": MODEL,
        "prompt": "a long story that nobody will read to the end",
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }
    headers = {"Authorization": f"Bearer {KEYS['d']}"}
    got = 0
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", served["base"] + "/v1/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    got += 1
                    if got == 3:
                        break
    # The connection is closed: the request must be aborted, not run to max_tokens.
    wait_pools_free()
    decode = 0
    for h in replicas().values():
        stats = ray.get(h.stats.remote(), timeout=30)
        decode += stats["tokens"].get("d", (0, 0))[1]
    print(f"disconnect: {decode} of {max_tokens} tokens decoded")
    assert 3 <= decode < max_tokens


def test_a_handle_stream_its_caller_cancels_is_aborted(served):
    # Ray Serve cancels a handle stream on `cancel()` (not when its caller merely stops
    # reading): the request must then be aborted, not run to max_tokens.
    max_tokens = 480
    req = {"prompt": "another long story", "tenant": "h", "max_tokens": max_tokens,
           "ignore_eos": True}  # fmt: skip
    gen = serve.get_app_handle("fairbatch").options(stream=True).generate.remote(req)
    got = [next(gen) for _ in range(3)]
    assert all(not c["finished"] for c in got)
    gen.cancel()
    wait_pools_free()
    decode = 0
    for h in replicas().values():
        decode += ray.get(h.stats.remote(), timeout=30)["tokens"].get("h", (0, 0))[1]
    print(f"handle cancel: {decode} of {max_tokens} tokens decoded")
    assert 3 <= decode < max_tokens


def test_delete_cancels_a_streaming_request(served):
    """DELETE /v1/requests/{id} goes through ClusterClient.abort: the replica aborts it, the
    stream ends with the cancellation error, and the blocks are free."""
    body = {
        "model": MODEL,
        "prompt": "a story cut short by its own author",
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    headers = {"Authorization": f"Bearer {KEYS['d']}"}
    events: list[dict] = []
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", served["base"] + "/v1/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                events.append(json.loads(line[len("data: ") :]))
                if len(events) == 2:
                    rid = events[0]["id"]
                    d = h.delete(f"{served['base']}/v1/requests/{rid}", headers=headers)
                    assert d.status_code == 200 and d.json()["cancelled"] is True
    assert events[-1]["error"]["code"] == "request_cancelled", events[-1]
    assert len(events) < body["max_tokens"]
    wait_pools_free()


# ---- handles ------------------------------------------------------------------------------------


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Caller:
    """A second app that uses fairbatch through its handle."""

    async def __call__(self, prompt: str) -> dict:
        fb = serve.get_app_handle("fairbatch")
        req = {"prompt": prompt, "tenant": "c", "max_tokens": 10, "temperature": 0.0}
        whole = await fb.complete.remote(dict(req, ignore_eos=True))
        chunks = []
        async for chunk in fb.options(stream=True).generate.remote(dict(req, ignore_eos=True)):
            chunks.append(chunk)
        return {"whole": whole, "chunks": chunks}


def test_handle_call_from_a_second_app(served):
    caller = serve.run(Caller.bind(), name="caller", route_prefix="/caller")
    out = caller.remote("hello from another app").result(timeout_s=120)
    whole, chunks = out["whole"], out["chunks"]
    assert whole["finish_reason"] == "length" and len(whole["token_ids"]) == 10
    assert whole["usage"]["completion_tokens"] == 10
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert [t for c in chunks for t in c["token_ids"]] == whole["token_ids"]
    assert chunks[-1]["finished"] and chunks[-1]["usage"]["completion_tokens"] == 10
    http = client(served, "c").completions.create(
        model=MODEL,
        prompt="hello from another app",
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert http.choices[0].text == whole["text"]
    serve.delete("caller")


def test_the_cluster_never_imports_ray_serve(served):
    """The controller and the replicas know each consumer's process (an ingress replica) by its
    actor id, never by its handle: a process deserializes a Serve replica's handle by importing
    Ray Serve (~0.6 s here), on the event loop that received it, and that held up the first
    requests of every new ingress. Checked after requests over HTTP and from a second app."""
    client(served, "c").completions.create(model=MODEL, prompt="hi", max_tokens=2)
    named = ray.util.list_named_actors(all_namespaces=True)
    (controller,) = [
        a for a in named if a["name"].startswith("fbtest-") and "controller" in a["name"]
    ]
    actors = {controller["name"]: ray.get_actor(controller["name"], controller["namespace"])}
    actors.update(replicas())
    assert len(actors) == 3
    imported = {
        name: ray.get(h.__ray_call__.remote(lambda self: "ray.serve" in sys.modules), timeout=30)
        for name, h in actors.items()
    }
    assert imported == {name: False for name in actors}


# ---- metrics (last: the earlier tests produced the samples) -----------------------------------


def test_metrics_on_the_metrics_port(served):
    port = ray.nodes()[0]["MetricsExportPort"]
    assert port == served["metrics_port"]
    wanted = [
        "ray_fairbatch_ttft_seconds_bucket{",
        "ray_fairbatch_tpot_seconds_bucket{",
        "ray_fairbatch_e2e_latency_seconds_bucket{",
        "ray_fairbatch_kv_usage_ratio{",
        "ray_fairbatch_running_seqs{",
        "ray_fairbatch_queue_depth{",
        "ray_fairbatch_tenant_virtual_counter{",
        "ray_fairbatch_rejections_total{",
    ]

    def scrape():
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        missing = [w for w in wanted if w not in text]
        return text if not missing else None

    text = wait_for(scrape, 60, "fairbatch metrics on the metrics port", every=1.0)
    assert 'tenant="a"' in text and 'tenant="q"' in text
    assert KEYS["a"] not in text and "quick brown fox" not in text
    assert 'SessionName="' in text  # the Grafana dashboard filters on it


def test_admin_lora_changes_outlive_the_ingress(served):
    """An adapter loaded and one unloaded through the admin API stay so when the ingress dies
    and Serve starts another: the new one takes them from the controller (which keeps them in
    Ray's GCS), over its config (which lists the unloaded one)."""
    admin = {"Authorization": f"Bearer {ADMIN}"}
    url = served["base"] + "/admin/loras"
    body = {"name": "kept", "path": served["lora"], "tenants": ["a"]}
    assert httpx.post(url, json=body, headers=admin, timeout=60).status_code == 200
    assert httpx.delete(url + "/tiny-lora", headers=admin, timeout=60).status_code == 200
    prompt = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}

    def text(tenant: str, model: str) -> httpx.Response:
        auth = {"Authorization": f"Bearer {KEYS[tenant]}"}
        body = {**prompt, "model": model}
        return httpx.post(served["base"] + "/v1/completions", json=body, headers=auth, timeout=60)

    before = text("a", "kept")
    assert before.status_code == 200, before.text
    ((old, actor),) = ingress_actors().items()
    sigkill(actor)

    def served_again() -> bool:
        try:
            return httpx.get(url, headers=admin, timeout=10).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(lambda: old not in ingress_actors() and served_again(), 180,
             "a new ingress")  # fmt: skip
    names = {m["name"] for m in httpx.get(url, headers=admin, timeout=30).json()["data"]}
    assert names == {"kept"}, names
    after = text("a", "kept")
    assert (
        after.status_code == 200
        and after.json()["choices"][0]["text"] == (before.json()["choices"][0]["text"])
    ), after.text
    assert text("h", "tiny-lora").status_code == 404


def test_deleting_the_app_stops_the_cluster(served):
    names = list(replicas())
    alive = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
    assert set(names) <= alive
    serve.delete("fairbatch")

    def gone():
        alive = ray.util.list_named_actors(all_namespaces=True)
        return not [a for a in alive if a["name"].startswith("fbtest-")]

    wait_for(gone, 60, "the cluster's actors to stop", every=1.0)
