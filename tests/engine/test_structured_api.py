"""response_format and forced tool calls through the HTTP API (deployments/api/structured.py),
with the official `openai` client and LangChain's ChatOpenAI over a LocalBackend on loopback;
references are the engine's own outputs for the same grammar."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from chat_fixtures import WEATHER
from loopback import ServerLoop

from fairbatch.deployments.api.backend import LocalBackend, create_app
from fairbatch.engine import LLM, SamplingParams
from fairbatch.engine.llm import build_engine
from fairbatch.engine.structured import GrammarSpec

MODEL = "fairbatch-tiny"
KEY = "key-structured"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served():
    loop = ServerLoop()
    backend = LocalBackend(build_engine("tiny", num_gpu_blocks=256, max_num_seqs=16))
    app = create_app(backend, {"tenants": [{"name": "t", "api_key": KEY}]})
    url = loop.serve(app)
    yield openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60), url
    loop.run(backend.shutdown())
    loop.close()


@pytest.fixture(scope="module")
def ref():
    return LLM("tiny")


def chat_reference(ref, schema, max_tokens=64):
    prompt = ref.tokenizer.apply_chat_template(MESSAGES)
    p = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, structured_output=GrammarSpec.from_schema(schema)
    )
    return ref.generate([ref.tokenizer.encode(prompt, add_special_tokens=False)], p, False)[0]


def json_schema_format(schema, name="person"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_chat_json_schema_equals_the_engine_and_validates(served, ref):
    c, _ = served
    out = c.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=64,
        response_format=json_schema_format(PERSON),
    )  # fmt: skip
    want = chat_reference(ref, PERSON)
    choice = out.choices[0]
    assert choice.message.content == want.text and choice.finish_reason == want.finish_reason
    if choice.finish_reason == "stop":
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_object_on_chat_and_completions_streamed_and_not(served):
    c, _ = served
    fmt = {"type": "json_object"}
    for i in range(3):
        out = c.chat.completions.create(
            model=MODEL, messages=MESSAGES, temperature=1.0, seed=i, max_tokens=64,
            response_format=fmt,
        )  # fmt: skip
        if out.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(out.choices[0].message.content), dict)
        done = c.completions.create(
            model=MODEL, prompt="JSON:", temperature=1.0, seed=i, max_tokens=64,
            extra_body={"response_format": fmt},
        )  # fmt: skip
        streamed = c.completions.create(
            model=MODEL, prompt="JSON:", temperature=1.0, seed=i, max_tokens=64, stream=True,
            extra_body={"response_format": fmt},
        )  # fmt: skip
        assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == done.choices[0].text
        if done.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(done.choices[0].text), dict)


def test_a_named_tool_call_is_returned_as_tool_calls(served, ref):
    c, _ = served
    choice = {"type": "function", "function": {"name": "get_weather"}}
    out = c.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=64, tools=[WEATHER, TIME],
        tool_choice=choice,
    )  # fmt: skip
    want = chat_reference(ref, WEATHER["function"]["parameters"])
    assert want.finish_reason == "stop"  # (else this test would not show the call)
    ch = out.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and call.function.arguments == want.text
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

    # streamed: id and name first, then argument fragments that add up to the same call
    stream = c.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=64, tools=[WEATHER, TIME],
        tool_choice=choice, stream=True,
    )  # fmt: skip
    items, reasons = [], []
    for chunk in stream:
        for chc in chunk.choices:
            items.extend(chc.delta.tool_calls or [])
            reasons.append(chc.finish_reason)
            assert not chc.delta.content
            # every chunk carries something (none for text the call's head still holds), and
            # the call's first item carries its first arguments: one entry per chunk
            delta = chc.delta.model_dump(exclude_none=True)
            assert delta or chc.finish_reason, chunk
            assert len(chc.delta.tool_calls or [None]) == 1, chunk
    assert items[0].id and items[0].function.name == "get_weather" and items[0].index == 0
    assert all(it.index == 0 and it.id is None for it in items[1:]) and len(items) > 2
    assert "".join(it.function.arguments or "" for it in items) == want.text
    assert reasons[-1] == "tool_calls"


def test_required_picks_one_of_the_tools(served):
    c, _ = served
    seen = set()
    for seed in range(4):
        kw = dict(model=MODEL, messages=MESSAGES, temperature=1.0, seed=seed, max_tokens=96)
        kw.update(tools=[WEATHER, TIME], tool_choice="required")
        out = c.chat.completions.create(**kw)
        ch = out.choices[0]
        streamed = list(c.chat.completions.create(**kw, stream=True))
        items = [
            it for chunk in streamed for chc in chunk.choices for it in chc.delta.tool_calls or []
        ]
        for chunk in streamed:  # none empty (while the head `{"name": ...` is held)
            for chc in chunk.choices:
                assert chc.delta.model_dump(exclude_none=True) or chc.finish_reason, chunk
        if ch.finish_reason != "tool_calls":
            assert ch.finish_reason == "length"
            continue
        (call,) = ch.message.tool_calls
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        seen.add(call.function.name)
        assert items[0].function.name == call.function.name
        assert "".join(it.function.arguments or "" for it in items) == call.function.arguments
    assert seen


def test_tool_choice_none_ignores_the_tools(served):
    c, _ = served
    kw = dict(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=8)
    plain = c.chat.completions.create(**kw)
    out = c.chat.completions.create(**kw, tools=[WEATHER], tool_choice="none")
    assert out.choices[0].message.content == plain.choices[0].message.content
    assert not out.choices[0].message.tool_calls


@pytest.mark.parametrize(
    "extra, needle",
    [
        ({"tools": [WEATHER]}, "tool_call_parser"),  # tool_choice defaults to auto
        ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_call_parser"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "not one of the tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}],
          "tool_choice": "required"}, "function.name"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}}, "schema"),
        ({"response_format": json_schema_format({"type": "nope"})}, "Unsupported type"),
        ({"tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "x"}}}}}],
          "tool_choice": "required"}, "Unsupported type"),
    ],
)  # fmt: skip
def test_unusable_requests_answer_400(served, extra, needle):
    _, url = served
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **extra}
    r = httpx.post(
        url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_an_unusable_schema_on_completions_answers_400(served):
    _, url = served
    body = {"model": MODEL, "prompt": "x", "response_format": json_schema_format({"type": "x"})}
    r = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and "cannot be used" in r.json()["error"]["message"]


# ---- LangChain ------------------------------------------------------------------------------


def chat_model(url: str):
    lc = pytest.importorskip("langchain_openai")
    return lc.ChatOpenAI(
        model=MODEL, base_url=url + "/v1", api_key=KEY, temperature=0, max_tokens=64,
        max_retries=0,
    )  # fmt: skip


def test_langchain_structured_output_and_bound_tools(served, ref):
    _, url = served
    pydantic = pytest.importorskip("pydantic")

    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=8)
        age: int

    llm = chat_model(url)
    structured = llm.with_structured_output(Person, method="json_schema")
    person = structured.invoke("Describe a person")
    assert isinstance(person, Person)

    class GetWeather(pydantic.BaseModel):
        """Weather of a city."""

        city: str = pydantic.Field(max_length=10)

    bound = llm.bind_tools([GetWeather], tool_choice="GetWeather")
    msg = bound.invoke("What is the weather in Paris?")
    (call,) = msg.tool_calls
    assert call["name"] == "GetWeather" and isinstance(call["args"]["city"], str)
    assert GetWeather(**call["args"])


# ---- the output -> tool_calls conversion, piece by piece ------------------------------------


@pytest.mark.parametrize("pieces", [1, 3, 1000])
def test_tool_call_stream_splits_the_same_way_whatever_the_pieces(pieces):
    from fairbatch.deployments.api.structured import ToolCallStream, ToolPlan

    args = '{"city": "Paris", "days": 3}'
    for plan, text in [
        (ToolPlan(("get_weather",), "get_weather"), args),
        (
            ToolPlan(("get_weather", "get_time")),
            '{"name": "get_weather", "arguments": ' + args + "}",
        ),
    ]:
        stream = ToolCallStream(plan)
        chunks = [text[i : i + pieces] for i in range(0, len(text), pieces)]
        deltas = [stream.delta(c, None)[0] for c in chunks[:-1]]
        last, finish, _ = stream.delta(chunks[-1], "stop")
        items = [it for d in [*deltas, last] for it in d.get("tool_calls", [])]
        assert finish == "tool_calls" and items[0]["function"]["name"] == "get_weather"
        assert "".join(it["function"]["arguments"] for it in items) == args
        message, reason = ToolCallStream(plan).message(text, "stop")
        assert reason == "tool_calls" and message["tool_calls"][0]["function"]["arguments"] == args

    cut = ToolCallStream(ToolPlan(("a", "b")))  # cut before the call's head: plain content
    assert cut.message('{"name": "a', "length") == (
        {"role": "assistant", "content": '{"name": "a'},
        "length",
    )


@pytest.mark.parametrize(
    "plan, text, reason, arguments",
    [
        (("get_weather",), '{"city": "Pa', "length", '{"city": "Pa'),
        (None, '{"name": "get_weather", "arguments": {"city": "Pa', "length", '{"city": "Pa'),
        (None, '{"name": "get_weather", "arguments": {"city": "P"}', "length", '{"city": "P"}'),
        (None, '{"name": "get_weather", "arguments": {"city": "P"} ', "timeout", '{"city": "P"} '),
    ],
)
def test_a_call_cut_short_is_the_call_so_far_whole_and_streamed(plan, text, reason, arguments):
    # As OpenAI returns a call that max_tokens cut: tool_calls with the arguments written so
    # far, finish_reason "length" (or fairbatch's "timeout"), the same whole and streamed.
    from fairbatch.deployments.api.structured import ToolCallStream, ToolPlan

    plan = ToolPlan(("get_weather", "get_time"), plan[0] if plan else None)
    message, finish = ToolCallStream(plan).message(text, reason)
    assert (finish, message["content"]) == (reason, None)
    (call,) = message["tool_calls"]
    assert (call["function"]["name"], call["function"]["arguments"]) == ("get_weather", arguments)
    for pieces in (1, 4, 1000):
        stream, chunks = (
            ToolCallStream(plan),
            [text[i : i + pieces] for i in range(0, len(text), pieces)],
        )
        deltas = [stream.delta(c, None)[0] for c in chunks[:-1]]
        last, got, _ = stream.delta(chunks[-1], reason)
        items = [it for d in [*deltas, last] for it in d.get("tool_calls", [])]
        assert got == reason and items[0]["function"]["name"] == "get_weather"
        assert "".join(it["function"]["arguments"] for it in items) == arguments
