"""A conversation with tool use goes back to the model: the assistant's earlier `tool_calls` and
the `tool` messages with their `tool_call_id` are accepted (the official `openai` client passes
the returned message back as it is; LangChain sends its AIMessage and ToolMessage), and the chat
template renders them and the `tools` exactly as Hugging Face transformers renders them (the
reference: the prompt token ids the engine got). Malformed history answers 400 naming the field.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from chat_fixtures import WEATHER, hf_tiny_tokenizer
from loopback import ServerLoop

from fairbatch.deployments.api.backend import LocalBackend, create_app
from fairbatch.engine.llm import build_engine
from fairbatch.engine.tokenizer import ASSETS_DIR, Tokenizer

MODEL = "fairbatch-tiny"
KEY = "key-tools"
QUESTION = {"role": "user", "content": "What is the weather in Paris?"}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# A template that renders tool use the way Qwen2-style templates do: the tools in a system turn,
# each earlier call as <tool_call> JSON with its arguments as an object, tool results as a user
# turn. (Written here; the tiny model's own ChatML template renders content only.)
TOOL_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|im_start|>system\n# Tools\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content }}"
    "{% for c in m.tool_calls %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}"
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n"
    "<tool_response id={{ m.tool_call_id }}>{{ m.content }}</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class RecordingBackend(LocalBackend):
    """LocalBackend that keeps the prompt token ids of every request."""

    prompts: list[list[int]]

    async def generate(self, prompt_token_ids, params, **kw):
        self.prompts.append(list(prompt_token_ids))
        async for delta in super().generate(prompt_token_ids, params, **kw):
            yield delta


@pytest.fixture(scope="module")
def served():
    loop = ServerLoop()
    backend = RecordingBackend(build_engine("tiny", num_gpu_blocks=256, max_num_seqs=8))
    backend.prompts = []
    backend.tokenizer = Tokenizer.from_files(
        ASSETS_DIR / "tiny_tokenizer.json",
        ASSETS_DIR / "tiny_tokenizer_config.json",
        chat_template=TOOL_TEMPLATE,
    )
    url = loop.serve(create_app(backend, {"tenants": [{"name": "t", "api_key": KEY}]}))
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    yield client, url, backend
    loop.run(backend.shutdown())
    loop.close()


@pytest.fixture(scope="module")
def hf():
    pytest.importorskip("transformers")
    return hf_tiny_tokenizer(TOOL_TEMPLATE)


def as_template_takes_it(message: dict) -> dict:
    """An assistant message as transformers' tool-use docs want it: arguments as an object."""
    calls = [
        {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
        for c in message["tool_calls"]
    ]
    return {"role": "assistant", "content": message["content"] or "", "tool_calls": calls}


def test_the_openai_clients_tool_loop_renders_as_transformers_does(served, hf):
    client, _, backend = served
    first = client.chat.completions.create(
        model=MODEL, messages=[QUESTION], tools=[WEATHER], tool_choice=NAMED, max_tokens=48,
        temperature=0,
    )  # fmt: skip
    msg = first.choices[0].message
    (call,) = msg.tool_calls
    assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'}
    n = len(backend.prompts)
    second = client.chat.completions.create(
        model=MODEL, messages=[QUESTION, msg, result], tools=[WEATHER], tool_choice="none",
        max_tokens=4, temperature=0,
    )  # fmt: skip
    reply = second.choices[0].message
    assert reply.content is not None and not reply.tool_calls
    (prompt,) = backend.prompts[n:]
    history = [QUESTION, as_template_takes_it(msg.model_dump()), result]
    text = hf.apply_chat_template(
        history, tools=[WEATHER], add_generation_prompt=True, tokenize=False
    )
    assert prompt == hf(text, add_special_tokens=False)["input_ids"]
    # and the template did render the call, its result and the tool
    assert f"<tool_response id={call.id}>" in text and '"arguments": {"city": ' in text
    assert '"name": "get_weather", "description": "Weather of a city"' in text


def test_langchain_sends_the_tool_result_back(served):
    _, url, backend = served
    lc = pytest.importorskip("langchain_openai")
    messages = pytest.importorskip("langchain_core.messages")
    llm = lc.ChatOpenAI(
        model=MODEL, base_url=url + "/v1", api_key=KEY, temperature=0, max_tokens=48,
        max_retries=0,
    )  # fmt: skip
    question = messages.HumanMessage("What is the weather in Paris?")
    ai = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke([question])
    (call,) = ai.tool_calls
    answer = messages.ToolMessage('{"celsius": 21}', tool_call_id=call["id"])
    n = len(backend.prompts)
    final = llm.bind_tools([WEATHER], tool_choice="none").invoke([question, ai, answer])
    assert isinstance(final.content, str) and not final.tool_calls
    (prompt,) = backend.prompts[n:]
    text = backend.tokenizer.decode(prompt, skip_special_tokens=False)
    assert f'<tool_response id={call["id"]}>{{"celsius": 21}}</tool_response>' in text
    rendered_call = {"name": "get_weather", "arguments": call["args"]}
    assert json.dumps(rendered_call, ensure_ascii=False) in text


@pytest.mark.parametrize(
    "history, param",
    [
        ([{"role": "user", "content": "x", "tool_calls": []}], "messages.0"),
        ([{"role": "user", "content": "x", "tool_call_id": "c1"}], "messages.0"),
        ([QUESTION, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{not json"}}]}],
         "messages.1.tool_calls.0.function.arguments"),
        ([QUESTION, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": "[1]"}}]}],
         "messages.1.tool_calls.0.function.arguments"),
        ([QUESTION, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function"}]}],
         "messages.1.tool_calls.0.function"),
        ([QUESTION, {"role": "tool", "tool_call_id": "c1"}], "messages.1.content"),
        ([QUESTION, {"role": "tool", "content": "21 C"}], "messages.1.tool_call_id"),
    ],
)  # fmt: skip
def test_malformed_tool_history_answers_400_naming_the_field(served, history, param):
    _, url, backend = served
    n = len(backend.prompts)
    body = {"model": MODEL, "messages": history, "max_tokens": 2}
    r = httpx.post(
        url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert len(backend.prompts) == n  # nothing reached the engine
