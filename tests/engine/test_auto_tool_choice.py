"""`tool_choice: "auto"`: the model writes freely and the calls it writes in the app's
`tool_call_parser` format come back as `tool_calls`, streamed and whole alike.

Three levels: the parsers on texts (the expected content and calls written out by hand, and every
split of the text into deltas giving the same reply); the API over a scripted backend that writes
a Hermes reply (the official openai client, streamed and not, and LangChain's `bind_tools`,
which sends no `tool_choice`, so "auto"); and the tiny model itself, steered by a grammar the
test adds into writing a Llama 3 JSON call, where the reference is the same text returned raw
with `tool_choice: "none"`.
"""

from __future__ import annotations

import dataclasses
import json
import random

import httpx
import openai
import pytest
from chat_fixtures import WEATHER, ScriptedReply
from loopback import ServerLoop

from fairbatch.deployments.api.backend import LocalBackend, create_app
from fairbatch.deployments.api.tool_parsers import PARSERS, AutoToolCalls, AutoToolPlan
from fairbatch.engine.tokenizer import Tokenizer

MODEL = "fairbatch-tiny"
KEY = "key-auto"
QUESTION = [{"role": "user", "content": "What is the weather in Paris and Rome?"}]
GW = "get_weather"
PARIS, ROME = {"city": "Paris", "days": 2}, {"city": "Rome"}


def hermes(name: str, args: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


HERMES_REPLY = "I will look it up.\n" + hermes(GW, PARIS) + "\n" + hermes(GW, ROME)
# Mistral before its v11 tokenizer: one JSON list after the special token
MISTRAL_REPLY = "Checking.[TOOL_CALLS] " + json.dumps(
    [{"name": GW, "arguments": PARIS}, {"name": GW, "arguments": ROME}]
)

# (parser, output, expected content, expected calls, engine reason, expected finish_reason)
CASES = [
    ("hermes", HERMES_REPLY, "I will look it up.", [(GW, PARIS), (GW, ROME)], "stop", "tool_calls"),
    ("hermes", hermes(GW, ROME), None, [(GW, ROME)], "stop", "tool_calls"),
    ("hermes", "Sunny in Paris, 21 C. \n", "Sunny in Paris, 21 C. \n", [], "stop", "stop"),
    ("hermes", "a < b <tool", "a < b <tool", [], "stop", "stop"),  # looked like a tag's start
    # a block naming no given tool, or with arguments that are no object: content, as written
    ("hermes", hermes("rm_rf", {}), hermes("rm_rf", {}), [], "stop", "stop"),
    ("hermes", "<tool_call>[1]</tool_call>", "<tool_call>[1]</tool_call>", [], "stop", "stop"),
    ("hermes", "x " + hermes(GW, ROME) + " y", "x y", [(GW, ROME)], "stop", "tool_calls"),
    # cut short: the call never closed, so it is content and the reason stays "length"
    ("hermes", 'Ok <tool_call>{"name": "get_weather", "argu', 'Ok <tool_call>{"name": '
     '"get_weather", "argu', [], "length", "length"),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
     '{"name": "get_weather", "arguments": {"city": "Rome"}}', None, [(GW, PARIS), (GW, ROME)],
     "stop", "tool_calls"),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}', None,
     [(GW, ROME)], "stop", "tool_calls"),
    ("llama3_json", 'It is {"name": "get_weather"}', 'It is {"name": "get_weather"}', [], "stop",
     "stop"),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Pa', '{"name": "get_weather", '
     '"parameters": {"city": "Pa', [], "length", "length"),
    ("llama3_json", '{"name": "nope", "parameters": {}}', '{"name": "nope", "parameters": {}}',
     [], "stop", "stop"),
    ("mistral", MISTRAL_REPLY, "Checking.", [(GW, PARIS), (GW, ROME)], "stop", "tool_calls"),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}[TOOL_CALLS]get_weather'
     '[CALL_ID]a1b2c3d4e[ARGS]{"city": "Rome"}', None, [(GW, PARIS), (GW, ROME)], "stop",
     "tool_calls"),
    ("mistral", "a [TOOL", "a [TOOL", [], "stop", "stop"),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": ', '[TOOL_CALLS]get_weather[ARGS]{"city": ',
     [], "length", "length"),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": "Paris"}]',
     '[TOOL_CALLS] [{"name": "get_weather", "arguments": "Paris"}]', [], "stop", "stop"),
    ("pythonic", '[get_weather(city="Paris", days=2), get_weather(city=\'Rome\')]', None,
     [(GW, PARIS), (GW, ROME)], "stop", "tool_calls"),
    ("pythonic", '<|python_start|>[get_weather(city="Rome")]<|python_end|>', None, [(GW, ROME)],
     "stop", "tool_calls"),
    ("pythonic", ' [get_time(zone=None, dst=True, at=[-1, 2.5], opts={"a": (1, 2)})]\n', None,
     [("get_time", {"zone": None, "dst": True, "at": [-1, 2.5], "opts": {"a": [1, 2]}})], "stop",
     "tool_calls"),
    ("pythonic", "It is sunny [in Rome].", "It is sunny [in Rome].", [], "stop", "stop"),
    ("pythonic", "[1, 2, 3]", "[1, 2, 3]", [], "stop", "stop"),  # a list, but of no calls
    # a positional argument; a value that is not a literal (never evaluated)
    ("pythonic", '[get_weather("Rome")]', '[get_weather("Rome")]', [], "stop", "stop"),
    ("pythonic", "[get_weather(city=open('x'))]", "[get_weather(city=open('x'))]", [], "stop",
     "stop"),
    ("pythonic", '[rm_rf(path="/")]', '[rm_rf(path="/")]', [], "stop", "stop"),  # no such tool
    ("pythonic", '[get_weather(city="Pa', '[get_weather(city="Pa', [], "length", "length"),
    ("pythonic", "[get_weather(**{'city': 'Rome'})]", "[get_weather(**{'city': 'Rome'})]", [],
     "stop", "stop"),
]  # fmt: skip


def calls_of(items: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in items]


def plan(parser: str, parallel: bool = True) -> AutoToolPlan:
    return AutoToolPlan(parser, (GW, "get_time"), parallel)


def id_ok(parser: str, call_id: str) -> bool:
    """Mistral's templates take ids of 9 letters and digits only; OpenAI's look like call_..."""
    if parser == "mistral":
        return len(call_id) == 9 and call_id.isascii() and call_id.isalnum()
    return call_id.startswith("call_")


@pytest.mark.parametrize("parser, text, content, calls, reason, finish", CASES)
def test_the_whole_reply_has_the_content_and_calls_the_model_wrote(
    parser, text, content, calls, reason, finish
):
    message, got = AutoToolCalls(plan(parser)).message(text, reason)
    assert got == finish
    assert message["content"] == content
    assert calls_of(message.get("tool_calls", [])) == calls
    ids = [c["id"] for c in message.get("tool_calls", [])]
    assert len(set(ids)) == len(ids) and all(id_ok(parser, i) for i in ids)


@pytest.mark.parametrize("parser, text, content, calls, reason, finish", CASES)
def test_every_split_into_deltas_streams_the_same_reply(
    parser, text, content, calls, reason, finish
):
    rng = random.Random(7)
    splits = [[1] * len(text), [2] * len(text), [5] * len(text)]
    splits += [[rng.randint(1, 12) for _ in text] for _ in range(20)]
    for sizes in splits:
        pieces, at = [], 0
        for n in sizes:
            if at >= len(text):
                break
            pieces.append(text[at : at + n])
            at += n
        stream = AutoToolCalls(plan(parser))
        out = [stream.delta(p, None, [i]) for i, p in enumerate(pieces[:-1])]
        out.append(stream.delta(pieces[-1], reason, [len(pieces) - 1]))
        assert [f for _, f, _ in out] == [None] * (len(pieces) - 1) + [finish]
        assert "".join(d.get("content", "") for d, _, _ in out) == (content or "")
        items = [c for d, _, _ in out for c in d.get("tool_calls", [])]
        assert calls_of(items) == calls and [c["index"] for c in items] == list(range(len(calls)))
        assert all(id_ok(parser, c["id"]) and c["type"] == "function" for c in items)
        # every record comes out once, in order
        assert [r for _, _, recs in out for r in recs] == list(range(len(pieces)))


def test_log_probs_go_out_with_the_text_they_score():
    stream = AutoToolCalls(plan("hermes"))
    pieces = ["Hi", " there", "<tool", "_call>", json.dumps({"name": GW, "arguments": ROME})]
    got = [stream.delta(p, None, [i]) for i, p in enumerate(pieces)]
    got.append(stream.delta("</tool_call>", "stop", [5]))
    assert [d.get("content") for d, _, _ in got] == ["Hi", " there", None, None, None, None]
    assert [recs for _, _, recs in got] == [[0], [1], [], [], [], [2, 3, 4, 5]]
    assert calls_of(got[-1][0]["tool_calls"]) == [(GW, ROME)]
    # trailing whitespace is held (it is dropped if a call follows), and its record with it
    stream = AutoToolCalls(plan("hermes"))
    assert stream.delta("Hi ", None, [0]) == ({"content": "Hi"}, None, [])
    assert stream.delta("you", None, [1]) == ({"content": " you"}, None, [0, 1])


def test_parallel_tool_calls_false_returns_the_first_call_only():
    message, finish = AutoToolCalls(plan("hermes", parallel=False)).message(HERMES_REPLY, "stop")
    assert finish == "tool_calls" and calls_of(message["tool_calls"]) == [(GW, PARIS)]
    assert message["content"] == "I will look it up."


def test_the_config_takes_exactly_the_parsers_that_exist():
    import typing

    from fairbatch.deployments.api.config import AppConfig, ConfigError, parse_config

    field = AppConfig.model_fields["tool_call_parser"].annotation
    assert set(typing.get_args(typing.get_args(field)[0])) == set(PARSERS)
    with pytest.raises(ConfigError, match="tool_call_parser"):
        parse_config({"tool_call_parser": "granite"})


# ---- the API over a scripted backend that writes a Hermes (or Mistral) reply ---------------------


@pytest.fixture(scope="module")
def scripted():
    loop = ServerLoop()
    backend = ScriptedReply(HERMES_REPLY)
    config = {"tenants": [{"name": "t", "api_key": KEY}], "tool_call_parser": "hermes"}
    url = loop.serve(create_app(backend, config))
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    yield client, url, backend
    loop.close()


def test_the_openai_client_gets_the_calls_whole(scripted):
    client, _, backend = scripted
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER])
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I will look it up."
    got = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert got == [(GW, PARIS), (GW, ROME)]
    assert backend.params[-1].structured_output is None  # the model wrote freely


def test_the_openai_client_gets_the_calls_streamed(scripted):
    client, _, _ = scripted
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=QUESTION, tools=[WEATHER], tool_choice="auto", stream=True
        )
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls: dict[int, dict] = {}
    for c in chunks:
        for tc in c.choices[0].delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
            call["name"] += tc.function.name or ""
            call["arguments"] += tc.function.arguments or ""
    assert content == "I will look it up."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (GW, PARIS),
        (GW, ROME),
    ]
    assert all(c["id"].startswith("call_") for c in calls.values())
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_langchain_bind_tools_gets_the_calls(scripted):
    lc = pytest.importorskip("langchain_openai")
    _, url, _ = scripted
    llm = lc.ChatOpenAI(model=MODEL, base_url=url + "/v1", api_key=KEY, max_retries=0)
    ai = llm.bind_tools([WEATHER]).invoke("What is the weather in Paris and Rome?")
    assert [(c["name"], c["args"]) for c in ai.tool_calls] == [(GW, PARIS), (GW, ROME)]
    assert ai.content == "I will look it up."


def test_auto_with_a_response_format_answers_400(scripted):
    _, url, backend = scripted
    n = len(backend.params)
    body = {"model": MODEL, "messages": QUESTION, "tools": [WEATHER], "tool_choice": "auto",
            "response_format": {"type": "json_object"}}  # fmt: skip
    r = httpx.post(
        f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    assert len(backend.params) == n


# ---- the tiny model, steered into writing a Llama 3 JSON call ----------------------------------

CALL_SCHEMA = {
    "type": "object",
    "properties": {"name": {"const": GW}, "parameters": WEATHER["function"]["parameters"]},
    "required": ["name", "parameters"],
}


class SteeredBackend(LocalBackend):
    """The engine with a grammar added to every request, so the tiny model's output is a call
    in the Llama 3 JSON format (the test's doing: the API itself adds no grammar for "auto")."""

    async def generate(self, prompt_token_ids, params, **kw):
        from fairbatch.engine.structured import GrammarSpec

        assert params.structured_output is None
        steered = dataclasses.replace(
            params, structured_output=GrammarSpec.from_schema(CALL_SCHEMA)
        )
        async for delta in super().generate(prompt_token_ids, steered, **kw):
            yield delta


@pytest.fixture(scope="module")
def steered():
    pytest.importorskip("xgrammar")
    from fairbatch.engine.llm import build_engine

    loop = ServerLoop()
    backend = SteeredBackend(build_engine("tiny", num_gpu_blocks=256, max_num_seqs=4))
    config = {"tenants": [{"name": "t", "api_key": KEY}], "tool_call_parser": "llama3_json"}
    url = loop.serve(create_app(backend, config))
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    yield client
    loop.run(backend.shutdown())
    loop.close()


def test_the_tiny_models_call_comes_back_as_tool_calls(steered):
    kw = dict(model=MODEL, messages=QUESTION, tools=[WEATHER], max_tokens=64, temperature=0)
    raw = steered.chat.completions.create(**kw, tool_choice="none").choices[0]
    assert raw.finish_reason == "stop", raw  # the grammar closed the object
    written = json.loads(raw.message.content)  # what the model wrote, as plain text
    want = [(written["name"], written["parameters"])]

    whole = steered.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    got = [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    assert got == want

    chunks = list(steered.chat.completions.create(**kw, stream=True))
    pieces = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(t.function.name, json.loads(t.function.arguments)) for t in pieces] == want
    assert not any(c.choices[0].delta.content for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


# Mistral's templates check the ids of the calls a conversation sends back (written here the way
# Mistral-7B-Instruct-v0.3's does; the tiny model's own template renders content only).
MISTRAL_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}"
    "{% for c in m.tool_calls %}{% if c.id | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{% endif %}[TOOL_CALLS]{{ c.function.name }}{% endfor %}"
    "{% else %}[INST]{{ m.content }}[/INST]{% endif %}{% endfor %}"
)


def test_mistral_calls_come_back_with_ids_its_template_takes():
    from fairbatch.engine.tokenizer import ASSETS_DIR

    loop = ServerLoop()
    backend = ScriptedReply(MISTRAL_REPLY)
    backend.tokenizer = Tokenizer.from_files(
        ASSETS_DIR / "tiny_tokenizer.json",
        ASSETS_DIR / "tiny_tokenizer_config.json",
        chat_template=MISTRAL_TEMPLATE,
    )
    config = {"tenants": [{"name": "t", "api_key": KEY}], "tool_call_parser": "mistral"}
    try:
        url = loop.serve(create_app(backend, config))
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=30)
        first = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER])
        # [TOOL_CALLS] is a special token: the request keeps special tokens in its text
        assert backend.params[-1].skip_special_tokens is False
        msg = first.choices[0].message
        got = [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls]
        assert got == [(GW, PARIS), (GW, ROME)] and msg.content == "Checking."
        results = [
            {"role": "tool", "tool_call_id": c.id, "content": '{"celsius": 21}'}
            for c in msg.tool_calls
        ]
        second = client.chat.completions.create(
            model=MODEL, messages=[*QUESTION, msg, *results], tools=[WEATHER], tool_choice="none"
        )  # the template took the ids (with call_<hex> ids it raises: a 400)
        assert second.choices[0].message.content == MISTRAL_REPLY
    finally:
        loop.close()
