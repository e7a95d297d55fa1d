"""LoRA adapters as models through the OpenAI API and the handle API (issue 46), over a
LocalBackend on the tiny model: the request's `model` field selects an adapter, and its
tokens equal the offline engine's under that adapter (which tests/engine/test_lora_engine.py
holds equal to transformers + PEFT); `GET /v1/models` lists what each tenant may use; a tenant
may not use an adapter it is not given (403), an unknown model is a 404; the admin API loads
(a broken directory is a 400 saying why, and nothing changes) and unloads (new requests 404,
a request already running ends with all its tokens); a reload under the same name serves the
new weights.
"""

from __future__ import annotations

import json

import httpx
import pytest
from loopback import ServerLoop

pytest.importorskip("peft")

from lora_adapters import make_tiny_adapter  # noqa: E402

from fairbatch.deployments.api.backend import LocalBackend, create_app  # noqa: E402
from fairbatch.deployments.api.config import ConfigError, parse_config  # noqa: E402
from fairbatch.engine import LLM, SamplingParams  # noqa: E402
from fairbatch.engine.llm import build_engine  # noqa: E402
from fairbatch.engine.lora import LoRARequest  # noqa: E402

BASE = "fairbatch-tiny"
ADMIN = "admin-key"
KEYS = {"alice": "key-alice", "bob": "key-bob"}
PROMPT = "The quick brown fox"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_loras")
    return {name: make_tiny_adapter(root / name, seed) for seed, name in enumerate("abc", 1)}


@pytest.fixture(scope="module")
def offline(dirs):
    """The offline engine's greedy text of PROMPT: base model (None) and each adapter."""
    llm = LLM("tiny", max_loras=2, max_lora_rank=8)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    out = {None: llm.generate([PROMPT], params, use_tqdm=False)[0].text}
    for name, path in dirs.items():
        (o,) = llm.generate([PROMPT], params, use_tqdm=False, lora=LoRARequest(name, path))
        out[name] = o.text
    assert len(set(out.values())) == len(out)  # each adapter changes the output
    return out


@pytest.fixture(scope="module")
def server(dirs):
    loop = ServerLoop()
    backend = LocalBackend(build_engine("tiny", max_loras=2, max_lora_rank=8, num_gpu_blocks=256))
    config = {
        "tenants": [{"name": n, "api_key": k} for n, k in KEYS.items()],
        "admin_api_key": ADMIN,
        "lora_adapters": [
            {"name": "a", "path": dirs["a"]},  # everyone
            {"name": "b", "path": dirs["b"], "tenants": ["bob"]},
        ],
    }
    app = create_app(backend, config)
    url = loop.serve(app)
    yield loop, url, app
    loop.run(backend.shutdown())
    loop.close()


def call(url, method, path, key, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.request(method, url + path, headers=headers, timeout=60, **kwargs)


def complete(url, key, model, **extra) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    return call(url, "POST", "/v1/completions", key, json={**body, "ignore_eos": True, **extra})


def test_model_field_selects_the_adapter_and_tokens_equal_the_offline_engine(server, offline):
    _, url, _ = server
    for key, model, want in [
        (KEYS["alice"], BASE, offline[None]),
        (KEYS["alice"], "a", offline["a"]),
        (KEYS["bob"], "b", offline["b"]),
    ]:
        r = complete(url, key, model)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        assert r.json()["choices"][0]["text"] == want


def test_models_lists_what_each_tenant_may_use(server):
    _, url, _ = server
    got = {
        name: [m["id"] for m in call(url, "GET", "/v1/models", key).json()["data"]]
        for name, key in KEYS.items()
    }
    assert got == {"alice": [BASE, "a"], "bob": [BASE, "a", "b"]}
    card = call(url, "GET", "/v1/models/b", KEYS["bob"]).json()
    assert (card["id"], card["parent"]) == ("b", BASE)
    assert call(url, "GET", "/v1/models/b", KEYS["alice"]).status_code == 403


def test_a_tenant_without_the_adapter_gets_403_and_an_unknown_model_404(server):
    _, url, _ = server
    r = complete(url, KEYS["alice"], "b")
    assert r.status_code == 403
    assert r.json()["error"]["code"] == "model_not_permitted"
    assert "tenant 'alice' may not use the LoRA adapter 'b'" in r.json()["error"]["message"]
    r = complete(url, KEYS["alice"], "nope")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
    assert "'b'" not in r.json()["error"]["message"]  # not told of others' adapters


def test_admin_load_refuses_a_broken_directory_and_changes_nothing(server, tmp_path):
    _, url, _ = server
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    before = call(url, "GET", "/admin/loras", ADMIN).json()["data"]
    r = call(url, "POST", "/admin/loras", ADMIN, json={"name": "x", "path": str(broken)})
    assert r.status_code == 400
    assert str(broken) in r.json()["error"]["message"]
    missing = {"name": "y", "path": str(tmp_path / "none")}
    assert call(url, "POST", "/admin/loras", ADMIN, json=missing).status_code == 400
    assert call(url, "GET", "/admin/loras", ADMIN).json()["data"] == before
    assert complete(url, KEYS["alice"], "x").status_code == 404
    assert complete(url, KEYS["alice"], "a").status_code == 200  # the others still serve
    # the admin key is needed; a name taken is a 409
    ok = {"name": "z", "path": before[0]["path"]}
    assert call(url, "POST", "/admin/loras", KEYS["bob"], json=ok).status_code == 401
    taken = {"name": "a", "path": before[0]["path"]}
    assert call(url, "POST", "/admin/loras", ADMIN, json=taken).status_code == 409


def test_unload_refuses_new_requests_and_lets_a_running_one_finish(server, dirs, offline):
    loop, url, _ = server
    long = 200
    headers = {"Authorization": f"Bearer {KEYS['alice']}"}
    body = {"model": "c", "prompt": PROMPT, "max_tokens": long, "temperature": 0}
    body |= {"ignore_eos": True, "stream": True}
    load = {"name": "c", "path": dirs["c"], "tenants": ["alice"]}
    assert call(url, "POST", "/admin/loras", ADMIN, json=load).status_code == 200

    async def run() -> tuple[int, str]:
        async with httpx.AsyncClient(timeout=120) as client:
            async with client.stream(
                "POST", url + "/v1/completions", json=body, headers=headers
            ) as r:
                assert r.status_code == 200
                lines = r.aiter_lines()
                first = await anext(lines)  # running now
                assert first.startswith("data: ")
                # unloaded while it runs: it goes on, new requests for "c" are refused
                gone = await client.delete(url + "/admin/loras/c", headers={
                    "Authorization": f"Bearer {ADMIN}"})  # fmt: skip
                assert gone.status_code == 200
                refused = await client.post(
                    url + "/v1/completions", json={**body, "stream": False}, headers=headers
                )
                assert refused.status_code == 404
                chunks = [first] + [line async for line in lines if line.startswith("data: ")]
        text, finish = "", None
        for c in chunks[:-1]:  # the last is [DONE]
            choice = json.loads(c[6:])["choices"][0]
            text += choice["text"]
            finish = choice["finish_reason"] or finish
        return finish, text

    finish, text = loop.run(run(), timeout=120)
    assert finish == "length"
    assert text.startswith(offline["c"])  # the adapter's tokens, to the end


def test_a_reload_under_the_same_name_serves_the_new_weights(server, dirs, offline):
    loop, url, _ = server
    for path, want in [(dirs["a"], offline["a"]), (dirs["c"], offline["c"])]:
        call(url, "DELETE", "/admin/loras/re", ADMIN)
        load = {"name": "re", "path": path}
        assert call(url, "POST", "/admin/loras", ADMIN, json=load).status_code == 200
        r = complete(url, KEYS["alice"], "re")
        assert r.json()["choices"][0]["text"] == want
    assert call(url, "DELETE", "/admin/loras/re", ADMIN).status_code == 200
    assert call(url, "DELETE", "/admin/loras/re", ADMIN).status_code == 404
    # the engine dropped every unloaded adapter (the weights and the slot), "c" too, unloaded
    # while a request ran under it: dropped at the next adapter read once that one ended
    backend = server[2].state.api.backend

    def held():
        slots = backend.engine.engine.scheduler.loras
        return sorted(slots.adapters), sorted(slots.pool.resident())

    adapters, resident = loop.run(backend.engine.call(held))
    assert adapters == ["a", "b"] and set(resident) <= {"a", "b"}


def test_the_handle_api_selects_loads_and_unloads_adapters(server, dirs, offline):
    from fairbatch.deployments.serve.handle_api import HandleApi

    loop, _, app = server

    class Ingress(HandleApi):
        api_app = app

    ingress = Ingress()
    call_ = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    out = loop.run(ingress.complete({**call_, "tenant": "bob", "model": "b"}))
    assert out["text"] == offline["b"]
    with pytest.raises(ValueError, match="may not use the LoRA adapter 'b'"):
        loop.run(ingress.complete({**call_, "tenant": "alice", "model": "b"}))
    assert loop.run(ingress.load_lora("h", dirs["c"], ["alice"]))["tenants"] == ["alice"]
    out = loop.run(ingress.complete({**call_, "tenant": "alice", "model": "h"}))
    assert out["text"] == offline["c"]
    loop.run(ingress.unload_lora("h"))
    with pytest.raises(ValueError, match="does not exist"):
        loop.run(ingress.complete({**call_, "tenant": "alice", "model": "h"}))
    with pytest.raises(ValueError, match="already loaded"):
        loop.run(ingress.load_lora("a", dirs["a"]))


def test_config_checks_adapter_names_and_tenants():
    good = {"tenants": [{"name": "t"}], "lora_adapters": [{"name": "x", "path": "/p"}]}
    assert parse_config(good).lora_adapters[0].tenants is None
    for adapters, says in [
        ([{"name": "x", "path": "/p"}, {"name": "x", "path": "/q"}], "names another model"),
        ([{"name": BASE, "path": "/p"}], "names another model"),
        ([{"name": "x", "path": "/p", "tenants": ["zed"]}], "unknown tenants"),
        ([{"name": "x y", "path": "/p"}], "lora_adapters.0.name"),
    ]:
        with pytest.raises(ConfigError, match=says):
            parse_config({**good, "lora_adapters": adapters})
