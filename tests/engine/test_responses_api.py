"""`POST /v1/responses` (OpenAI's Responses API) through the chat path: the tiny model's reply and
usage equal those of the same chat request; the streamed events are the Responses sequence (as
the OpenAI SDK's stream helper checks it) and add up to the whole reply; instructions and input
items render the same prompt as their chat messages; tool calls and reasoning come back as
`function_call` and `reasoning` items; bad input is a 400 naming its field."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from chat_fixtures import WEATHER, ScriptedReply
from loopback import ServerLoop

from fairbatch.deployments.api.backend import LocalBackend, create_app
from fairbatch.engine.tokenizer import ASSETS_DIR, Tokenizer

MODEL = "fairbatch-tiny"
KEY = "key-resp"
TENANTS = {"tenants": [{"name": "t", "api_key": KEY}]}
# WEATHER as the Responses API writes a function tool (flat, no "function" wrapper)
WEATHER_TOOL = {"type": "function", **WEATHER["function"]}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'


@pytest.fixture(scope="module")
def tiny():
    from fairbatch.engine.llm import build_engine

    loop = ServerLoop()
    backend = LocalBackend(build_engine("tiny", num_gpu_blocks=256, max_num_seqs=4))
    url = loop.serve(create_app(backend, TENANTS))
    yield openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    loop.run(backend.shutdown())
    loop.close()


class Scripted:
    """An app over `ScriptedReply(reply)` with `config` added: (client, backend, base url)."""

    def __init__(self, reply: str, tokenizer: Tokenizer | None = None, **config) -> None:
        self.loop = ServerLoop()
        self.backend = ScriptedReply(reply)
        if tokenizer is not None:
            self.backend.tokenizer = tokenizer
        self.url = self.loop.serve(create_app(self.backend, {**TENANTS, **config}))
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0)

    def close(self) -> None:
        self.loop.close()


def whole_and_streamed(client: openai.OpenAI, kw: dict) -> tuple[Any, list[str], Any]:
    """The response to `kw` whole, and streamed: its event types and its final response (the
    SDK's stream helper checks every event against the items it has seen)."""
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        kinds = [e.type for e in stream]
        return whole, kinds, stream.get_final_response()


def test_a_response_has_the_reply_and_usage_of_the_same_chat_request(tiny):
    got = tiny.responses.create(
        model=MODEL,
        instructions="Answer briefly.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Hello there"}]}],
        max_output_tokens=12,
        temperature=0,
    )
    want = tiny.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Hello there"},
        ],
        max_completion_tokens=12,
        temperature=0,
    )
    assert want.choices[0].finish_reason == "length"
    assert got.output_text == want.choices[0].message.content
    assert got.status == "incomplete" and got.incomplete_details.reason == "max_output_tokens"
    assert (got.usage.input_tokens, got.usage.output_tokens, got.usage.total_tokens) == (
        want.usage.prompt_tokens,
        want.usage.completion_tokens,
        want.usage.total_tokens,
    )
    (item,) = got.output
    # the message it was writing when max_output_tokens cut it short (as OpenAI marks it)
    assert item.type == "message" and item.role == "assistant" and item.status == "incomplete"
    assert got.id.startswith("resp_") and got.object == "response" and got.store is False


def test_streamed_events_are_the_responses_sequence_and_add_up_to_the_reply(tiny):
    kw = dict(model=MODEL, input="Hello there", max_output_tokens=12, temperature=0)
    whole = tiny.responses.create(**kw)
    with tiny.responses.stream(**kw) as stream:  # the SDK's helper checks each event's item
        events = list(stream)
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    n = len(deltas)
    assert n >= 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * n,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # max_output_tokens: as OpenAI ends such a stream
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in deltas)
    assert text == whole.output_text
    item = events[2].item
    assert all(e.item_id == item.id and e.output_index == 0 for e in deltas)
    assert events[-2].item.id == item.id and events[-2].item.content[0].text == text
    assert events[-2].item.status == "incomplete"
    last = events[-1].response
    assert last.status == "incomplete" and last.output_text == text
    assert [i.status for i in last.output] == ["incomplete"]
    assert last.usage.output_tokens == whole.usage.output_tokens == 12
    assert events[0].response.status == "in_progress" and events[0].response.output == []


# A template that shows every part of a conversation a chat request can carry.
SHOW_ALL = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[{{ c.id }}:{{ c.function.name }}"
    "{{ c.function.arguments | tojson }}]{% endfor %}"
    "{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}{% endfor %}"
)


def test_instructions_and_input_items_render_the_prompt_of_their_chat_messages():
    tok = Tokenizer.from_files(
        ASSETS_DIR / "tiny_tokenizer.json",
        ASSETS_DIR / "tiny_tokenizer_config.json",
        chat_template=SHOW_ALL,
    )
    app = Scripted("Sunny.", tok)
    args = '{"city": "Rome"}'
    try:
        app.client.responses.create(
            model=MODEL,
            instructions="Be brief.",
            input=[
                {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                {"type": "message", "role": "assistant",
                 "content": [{"type": "output_text", "text": "Checking."}]},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                 "arguments": args},
                {"type": "function_call", "call_id": "call_2", "name": "get_weather",
                 "arguments": '{"city": "Oslo"}'},
                {"type": "function_call_output", "call_id": "call_1", "output": "21 C"},
                {"type": "function_call_output", "call_id": "call_2", "output": "3 C"},
                {"type": "reasoning", "id": "rs_1", "summary": []},  # not shown to the model
                {"role": "user", "content": "And tomorrow?"},
            ],
            tools=[WEATHER_TOOL],
            tool_choice="none",
        )  # fmt: skip
        from_responses = app.backend.prompts[-1]
        calls = [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": args}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
        ]  # fmt: skip
        app.client.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "Checking.", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
                {"role": "tool", "tool_call_id": "call_2", "content": "3 C"},
                {"role": "user", "content": "And tomorrow?"},
            ],
            tools=[WEATHER],
            tool_choice="none",
        )
        assert from_responses == app.backend.prompts[-1]
        shown = tok.decode(from_responses)
        assert "<system>Be brief.<user>Weather?<assistant>Checking.[call_1:get_weather" in shown
        assert "<tool>21 C(call_1)<tool>3 C(call_2)<user>And tomorrow?" in shown
    finally:
        app.close()


def test_tool_calls_come_back_as_function_call_items_whole_and_streamed():
    app = Scripted("Checking." + CALL, tool_call_parser="hermes")
    kw = dict(model=MODEL, input="Weather in Rome?", tools=[WEATHER_TOOL])
    try:
        whole, kinds, streamed = whole_and_streamed(app.client, kw)
        for r in (whole, streamed):
            message, call = r.output
            assert message.type == "message" and message.content[0].text == "Checking."
            assert call.type == "function_call" and call.name == "get_weather"
            assert json.loads(call.arguments) == {"city": "Rome"} and call.call_id
            assert r.status == "completed"
        assert "response.function_call_arguments.done" in kinds
        assert kinds[-1] == "response.completed"
        assert [t["name"] for t in whole.model_dump()["tools"]] == ["get_weather"]
    finally:
        app.close()


def test_a_named_tool_choice_forces_that_call_and_text_format_sets_the_grammar():
    pytest.importorskip("xgrammar")
    # what the grammar would make the model write; every delta its own chunk
    app = Scripted('{"city": "Rome"}', stream_interval_ms=0)
    named = {"type": "function", "name": "get_weather"}
    kw = dict(model=MODEL, input="Weather in Rome?", tools=[WEATHER_TOOL], tool_choice=named)
    try:
        whole = app.client.responses.create(**kw)
        forced = app.backend.params[-1].structured_output
        with app.client.responses.stream(**kw) as stream:  # arguments stream in fragments
            n_fragments = sum(e.type == "response.function_call_arguments.delta" for e in stream)
            streamed = stream.get_final_response()
        for r in (whole, streamed):
            (call,) = r.output
            assert call.type == "function_call" and call.name == "get_weather"
            assert json.loads(call.arguments) == {"city": "Rome"}
        assert n_fragments > 1 and forced is not None
        assert json.loads(forced.json_schema) == WEATHER["function"]["parameters"]

        schema = {"type": "object", "properties": {"answer": {"type": "integer"}}}
        fmt = {"type": "json_schema", "name": "reply", "schema": schema, "strict": True}
        app.client.responses.create(model=MODEL, input="2 + 2?", text={"format": fmt})
        assert json.loads(app.backend.params[-1].structured_output.json_schema) == schema
        app.client.responses.create(model=MODEL, input="hi", text={"format": {"type": "text"}})
        assert app.backend.params[-1].structured_output is None
    finally:
        app.close()


def test_a_reasoning_parsers_thinking_comes_back_as_a_reasoning_item():
    reply = "2 and 2 make 4.</think>It is 4."
    app = Scripted(reply, reasoning_parser="deepseek_r1")
    kw = dict(model=MODEL, input="What is 2 + 2?")
    pieces = [reply[i : i + 3] for i in range(0, len(reply), 3)]  # a token each
    thinking = next(k for k in range(1, len(pieces)) if "</think>" in "".join(pieces[:k]))
    try:
        whole, kinds, streamed = whole_and_streamed(app.client, kw)
        for r in (whole, streamed):
            thought, answer = r.output
            assert thought.type == "reasoning"
            assert thought.content[0].text == "2 and 2 make 4."
            assert answer.type == "message" and r.output_text == "It is 4."
            assert (r.usage.output_tokens, thinking) == (len(pieces), 8)
            assert r.usage.output_tokens_details.reasoning_tokens == thinking
        assert kinds.index("response.reasoning_text.done") < kinds.index(
            "response.content_part.added"
        )
    finally:
        app.close()


@pytest.mark.parametrize(
    "change, param",
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": []}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input.0.content"),
        ({"input": [{"type": "file_search_call", "id": "x"}]}, "input.0"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
        ({"tools": [{"type": "web_search"}]}, "tools.0"),
        ({"text": {"format": {"type": "xml"}}}, "text.format"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"background": True}, "background"),
        ({"stream_options": {"include_obfuscation": False}}, "stream_options"),  # without stream
        ({"frobnicate": 1}, "frobnicate"),
        # found by the chat request it is served as, and named by this request's own fields
        (
            {
                "input": [
                    {"role": "user", "content": "hi"},
                    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                    {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "[1]"},
                ]
            },
            "input.2.arguments",
        ),
        (
            {
                "instructions": "x",
                "input": [{"role": "assistant", "content": [{"type": "output_text", "text": 7}]}],
            },
            "input.0.content",
        ),
        ({"input": "word " * 5000}, "input"),  # over the context
        ({"max_output_tokens": 4096}, "max_output_tokens"),  # with the prompt, over it
        ({"tools": [{"type": "function", "name": "f", "parameters": 3}]}, "tools.0.parameters"),
        (
            {"text": {"format": {"type": "json_schema", "name": "r", "schema": {"type": "no"}}}},
            "text.format",
        ),
    ],
)
def test_bad_input_is_a_400_naming_its_field(change, param):
    app = Scripted("x")
    try:
        body = {"model": MODEL, "input": "hi", **change}
        r = httpx.post(
            app.url + "/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY}"}
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text
        assert app.backend.prompts == []  # nothing reached the backend
    finally:
        app.close()


class TimesOut(ScriptedReply):
    """Writes its reply, then the request's deadline passes (finish reason "timeout")."""

    async def generate(self, prompt_token_ids, params, **kw):
        from fairbatch.engine.outputs import RequestDelta

        async for item in super().generate(prompt_token_ids, params, **kw):
            item.finished, item.finish_reason = False, None
            yield item
        yield RequestDelta("r", [], "", True, "timeout")


def test_a_deadline_that_passes_makes_the_response_incomplete():
    app = Scripted("So far.")
    app.backend.__class__ = TimesOut
    try:
        kw = dict(model=MODEL, input="hi", extra_body={"timeout": 5})
        whole = app.client.responses.create(**kw)
        with app.client.responses.stream(**kw) as stream:
            last = list(stream)[-1]
        for r in (whole, last.response):
            assert r.output_text == "So far." and r.incomplete_details.reason == "timeout"
        assert whole.status == "incomplete" and last.type == "response.incomplete"
    finally:
        app.close()


def test_fields_with_nothing_to_do_here_are_accepted():
    app = Scripted("Hello.")
    try:
        r = app.client.responses.create(
            model=MODEL, input="hi", store=True, background=False, service_tier="auto",
            prompt_cache_key="k1", safety_identifier="u1", metadata={"run": "7"},
            reasoning={"effort": "low"}, truncation="disabled", include=[],
        )  # fmt: skip
        assert r.output_text == "Hello." and r.store is False and r.metadata == {"run": "7"}
        with app.client.responses.stream(
            model=MODEL, input="hi", stream_options={"include_obfuscation": False}
        ) as stream:
            assert stream.get_final_response().output_text == "Hello."
    finally:
        app.close()


def test_langchain_over_the_responses_api_a_call_and_its_result():
    langchain_openai = pytest.importorskip("langchain_openai")
    app = Scripted("Checking." + CALL, tool_call_parser="hermes")
    try:
        llm = langchain_openai.ChatOpenAI(
            model=MODEL, base_url=app.url + "/v1", api_key=KEY, use_responses_api=True
        )
        from langchain_core.messages import HumanMessage, ToolMessage

        bound = llm.bind_tools([WEATHER])
        question = HumanMessage("Weather in Rome?")
        reply = bound.invoke([question])
        assert reply.tool_calls[0]["name"] == "get_weather"
        assert reply.tool_calls[0]["args"] == {"city": "Rome"}
        assert reply.text == "Checking."
        # the second turn: LangChain sends its reply's items back, with the tool's result
        result = ToolMessage(content="It is 21 C.", tool_call_id=reply.tool_calls[0]["id"])
        bound.invoke([question, reply, result])
        assert "It is 21 C." in app.backend.tokenizer.decode(app.backend.prompts[-1])
    finally:
        app.close()


class Endless(ScriptedReply):
    """Writes its reply again and again until the request is aborted."""

    aborted: set = set()

    async def generate(self, prompt_token_ids, params, *, request_id, **kw):
        import asyncio

        from fairbatch.engine.outputs import RequestDelta

        while request_id not in self.aborted:
            yield RequestDelta("r", [1], self.reply, False, None)
            await asyncio.sleep(0.01)
        yield RequestDelta("r", [], "", True, "abort")

    async def abort(self, request_id: str) -> bool:
        self.aborted.add(request_id)
        return True


def test_a_response_in_progress_is_found_and_cancelled_by_its_id():
    app = Scripted("more ")
    app.backend.__class__ = Endless
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        with app.client.responses.stream(model=MODEL, input="hi") as stream:
            events = iter(stream)
            rid = next(events).response.id  # response.created
            assert rid.startswith("resp_")
            got = httpx.get(f"{app.url}/v1/requests/{rid}", headers=auth)
            assert got.status_code == 200 and got.json()["id"] == rid, got.text
            assert got.json()["status"] == "running"
            cancel = httpx.delete(f"{app.url}/v1/requests/{rid}", headers=auth)
            assert cancel.status_code == 200 and cancel.json()["cancelled"] is True
            kinds = [e.type for e in events]
        assert kinds[-1] == "response.failed"  # the cancelled request's stream ends
        assert httpx.get(f"{app.url}/v1/requests/{rid}", headers=auth).status_code == 404
    finally:
        app.close()
