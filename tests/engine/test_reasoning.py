"""`reasoning_parser: deepseek_r1`: a reasoning model's thinking (up to `</think>`) comes back as
`reasoning_content`, the rest as content (or as tool calls with `tool_choice: "auto"`), streamed
and whole alike; a request with a grammar is not split. The expected splits are written out by
hand; every split of the text into deltas must give the same reply.

`reasoning_parser: qwen3` (below): only an output that opens with `<think>` thinks (Qwen3 writes
the tag itself), and `chat_template_kwargs: {"enable_thinking": false}` turns the split off, as
vLLM's qwen3 parser does; through the API with Qwen3's real chat template."""

from __future__ import annotations

import json
import random
from pathlib import Path

import openai
import pytest
from chat_fixtures import ScriptedReply
from loopback import ServerLoop

from fairbatch.deployments.api.backend import create_app
from fairbatch.deployments.api.reasoning import ReasoningSplit, mode
from fairbatch.deployments.api.tool_parsers import AutoToolCalls, AutoToolPlan
from fairbatch.engine.tokenizer import Tokenizer

MODEL = "fairbatch-tiny"
KEY = "key-think"
QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'

# (output, engine reason, reasoning, content, finish_reason)
CASES = [
    ("2 and 2 make 4.\n</think>\n\nIt is 4.", "stop", "2 and 2 make 4.\n", "\n\nIt is 4.", "stop"),
    ("<think>hmm</think>ok", "stop", "hmm", "ok", "stop"),
    ("<thinking is not the tag</think>x", "stop", "<thinking is not the tag", "x", "stop"),
    ("it never ends its thinking", "stop", "it never ends its thinking", None, "stop"),
    ("cut short </thi", "length", "cut short </thi", None, "length"),
    ("</think>only an answer", "stop", None, "only an answer", "stop"),
    ("<thi", "length", "<thi", None, "length"),
]  # fmt: skip


def pieces_of(text: str, rng: random.Random) -> list[list[str]]:
    """The text cut into pieces of 1 and of 3 characters, and 15 times at random."""
    out = []
    for fixed in (1, 3, *([None] * 15)):
        got, at = [], 0
        while at < len(text):
            n = fixed or rng.randint(1, 9)
            got.append(text[at : at + n])
            at += n
        out.append(got)
    return out


def stream(converter, pieces: list[str], reason: str) -> list[tuple[dict, str | None, list]]:
    out = [converter.delta(p, None, [i]) for i, p in enumerate(pieces[:-1])]
    return [*out, converter.delta(pieces[-1], reason, [len(pieces) - 1])]


@pytest.mark.parametrize("text, reason, reasoning, content, finish", CASES)
def test_the_thinking_and_the_answer_come_apart(text, reason, reasoning, content, finish):
    message, got = ReasoningSplit().message(text, reason)
    assert message == {"role": "assistant", "content": content, "reasoning_content": reasoning}
    assert got == finish
    for pieces in pieces_of(text, random.Random(3)):
        out = stream(ReasoningSplit(), pieces, reason)
        assert "".join(d.get("reasoning_content", "") for d, _, _ in out) == (reasoning or "")
        assert "".join(d.get("content", "") for d, _, _ in out) == (content or "")
        assert [f for _, f, _ in out] == [None] * (len(pieces) - 1) + [finish]
        assert [r for _, _, rs in out for r in rs] == list(range(len(pieces)))


def test_log_probs_wait_for_a_possible_end_tag():
    split = ReasoningSplit()
    got = [split.delta(p, None, [i]) for i, p in enumerate(["a", " b</th", "ink>c"])]
    got.append(split.delta("d", "stop", [3]))
    assert [(d, rs) for d, _, rs in got] == [
        ({"reasoning_content": "a"}, [0]),
        ({"reasoning_content": " b"}, []),
        ({"content": "c"}, [1, 2]),
        ({"content": "d"}, [3]),
    ]


def test_calls_after_the_thinking_are_tool_calls():
    text = "The user wants weather.</think>" + CALL
    plan = AutoToolPlan("hermes", ("get_weather",))
    message, finish = ReasoningSplit(AutoToolCalls(plan)).message(text, "stop")
    assert finish == "tool_calls" and message["content"] is None
    assert message["reasoning_content"] == "The user wants weather."
    (call,) = message["tool_calls"]
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == (
        "get_weather",
        {"city": "Rome"},
    )
    for pieces in pieces_of(text, random.Random(5)):
        out = stream(ReasoningSplit(AutoToolCalls(plan)), pieces, "stop")
        assert "".join(d.get("reasoning_content", "") for d, _, _ in out) == (
            "The user wants weather."
        )
        calls = [c for d, _, _ in out for c in d.get("tool_calls", [])]
        assert [c["function"]["name"] for c in calls] == ["get_weather"]
        assert not any(d.get("content") for d, _, _ in out) and out[-1][1] == "tool_calls"
    # a call inside the thinking is thinking, not a call
    message, finish = ReasoningSplit(AutoToolCalls(plan)).message(CALL + "</think>no", "stop")
    assert message["reasoning_content"] == CALL and message["content"] == "no"
    assert "tool_calls" not in message and finish == "stop"


def reasoning_tokens_of(tokenizer, ids: list[int]) -> int:
    """The reference: the fewest output tokens whose decoded text holds </think> (all of them
    when none does)."""
    for k in range(1, len(ids) + 1):
        if ReasoningSplit.END in tokenizer.decode(ids[:k]):
            return k
    return len(ids)


@pytest.mark.parametrize(
    "text",
    [c[0] for c in CASES] + ["né, 雨 🌧</think>ça ✓", "🌧🌧</think>", "x" * 40 + "</think>"],
)
def test_the_reasoning_tokens_are_those_up_to_the_end_tag(text):
    from fairbatch.engine.detokenizer import IncrementalDetokenizer
    from fairbatch.engine.tokenizer import Tokenizer

    tok = Tokenizer.tiny()
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.add_token(t) for t in ids]  # as the engine makes them: one token each
    deltas[-1] += detok.finish()
    assert "".join(deltas) == text
    if "🌧" in text:  # a token ends inside the character: its text is held to the next one
        assert "" in deltas
    split = ReasoningSplit()
    for piece in deltas:
        split.count(piece, 1)
    assert split.reasoning_tokens == reasoning_tokens_of(tok, ids)


# ---- through the API ----------------------------------------------------------------------------

REPLY = "Two and two.\n</think>\n\nIt is 4."


@pytest.fixture(scope="module")
def backend():
    return ScriptedReply(REPLY, piece=4)


@pytest.fixture(scope="module")
def client(backend):
    loop = ServerLoop()
    config = {"tenants": [{"name": "t", "api_key": KEY}], "reasoning_parser": "deepseek_r1"}
    url = loop.serve(create_app(backend, config))
    yield openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    loop.close()


# The scripted backend writes REPLY 4 characters a token: the reasoning is every piece up to
# the one that completes </think>, whatever the stream interval merges.
PIECES = [REPLY[i : i + 4] for i in range(0, len(REPLY), 4)]
REASONING_TOKENS = next(k for k in range(len(PIECES)) if "</think>" in "".join(PIECES[: k + 1])) + 1


def test_the_openai_client_gets_the_reasoning_apart(client):
    out = client.chat.completions.create(model=MODEL, messages=QUESTION)
    msg = out.choices[0].message
    assert (msg.reasoning_content, msg.content) == ("Two and two.\n", "\n\nIt is 4.")
    assert REASONING_TOKENS == 6 and out.usage.completion_tokens == len(PIECES) == 8
    assert out.usage.completion_tokens_details.reasoning_tokens == REASONING_TOKENS
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=QUESTION, stream=True, stream_options={"include_usage": True}
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    thought = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert (thought, "".join(d.content or "" for d in deltas)) == ("Two and two.\n", "\n\nIt is 4.")
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "stop"
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == REASONING_TOKENS
    # n samples: their reasoning tokens add up, as their completion tokens do
    two = client.chat.completions.create(model=MODEL, messages=QUESTION, n=2)
    assert two.usage.completion_tokens_details.reasoning_tokens == 2 * REASONING_TOKENS


def test_the_reply_goes_back_in_the_conversation_without_its_thinking(client, backend):
    first = client.chat.completions.create(model=MODEL, messages=QUESTION).choices[0].message
    assert first.reasoning_content  # the message as the client got it, passed back as it is
    again = [*QUESTION, first, {"role": "user", "content": "And 3 + 3?"}]
    client.chat.completions.create(model=MODEL, messages=again)
    prompt = backend.tokenizer.decode(backend.prompts[-1], skip_special_tokens=False)
    assert "It is 4." in prompt and "Two and two" not in prompt
    bad = [{"role": "user", "content": "x", "reasoning_content": "y"}]
    with pytest.raises(openai.BadRequestError, match="reasoning_content"):
        client.chat.completions.create(model=MODEL, messages=bad)


def test_a_request_with_a_grammar_is_not_split(client):
    pytest.importorskip("xgrammar")
    out = client.chat.completions.create(
        model=MODEL, messages=QUESTION, response_format={"type": "json_object"}
    )
    msg = out.choices[0].message
    assert msg.content == REPLY and getattr(msg, "reasoning_content", None) is None
    assert out.usage.completion_tokens_details is None


def test_without_a_reasoning_parser_the_usage_has_no_reasoning_tokens(backend):
    loop = ServerLoop()
    try:
        url = loop.serve(create_app(backend, {"tenants": [{"name": "t", "api_key": KEY}]}))
        plain = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=30)
        out = plain.chat.completions.create(model=MODEL, messages=QUESTION)
        assert out.choices[0].message.content == REPLY and out.usage.completion_tokens == 8
        assert out.usage.completion_tokens_details is None
    finally:
        loop.close()


def test_the_config_takes_the_parser_and_refuses_others():
    from fairbatch.deployments.api.config import ConfigError, parse_config

    assert parse_config({"reasoning_parser": "deepseek_r1"}).reasoning_parser == "deepseek_r1"
    assert parse_config({"reasoning_parser": "qwen3"}).reasoning_parser == "qwen3"
    with pytest.raises(ConfigError, match="reasoning_parser"):
        parse_config({"reasoning_parser": "granite"})


def test_chat_accepts_the_fields_it_has_nothing_to_do_for(client):
    # as /v1/responses does: nothing is stored, one service tier, the tenant's cache salt
    kw = dict(model=MODEL, messages=QUESTION, store=True, metadata={"run": "7"})
    kw.update(service_tier="auto", prompt_cache_key="k1", safety_identifier="u1")
    assert client.chat.completions.create(**kw).choices[0].message.content == "\n\nIt is 4."
    for bad, param in [
        ({"service_tier": "flex"}, "service_tier"),
        ({"metadata": {"a": 1}}, "metadata.a"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=QUESTION, extra_body=bad)
        assert e.value.body["param"] == param


# ---- qwen3 ------------------------------------------------------------------------------------

# (output, engine reason, reasoning, content, finish_reason) with mode "tag": Qwen3 opens its
# thinking with <think> itself; an output that does not open with it is the answer
QWEN3_CASES = [
    ("<think>\nadd\n</think>\n\nIt is 4.", "stop", "\nadd\n", "\n\nIt is 4.", "stop"),
    ("It is 4.", "stop", None, "It is 4.", "stop"),
    ("<think>\nnever closed", "length", "\nnever closed", None, "length"),
    ("</think>stray end tag", "stop", None, "</think>stray end tag", "stop"),
    (" <think>not first</think>x", "stop", None, " <think>not first</think>x", "stop"),
    ("<think></think>\n\nempty thinking", "stop", None, "\n\nempty thinking", "stop"),
    ("<thi", "length", None, "<thi", "length"),
    ("<", "stop", None, "<", "stop"),
]  # fmt: skip


@pytest.mark.parametrize("text, reason, reasoning, content, finish", QWEN3_CASES)
def test_qwen3_splits_only_an_output_that_opens_its_thinking(
    text, reason, reasoning, content, finish
):
    message, got = ReasoningSplit(mode="tag").message(text, reason)
    assert message == {"role": "assistant", "content": content, "reasoning_content": reasoning}
    assert got == finish
    for pieces in pieces_of(text, random.Random(7)):
        split = ReasoningSplit(mode="tag")
        out = []
        for i, p in enumerate(pieces):
            split.count(p, 1)
            out.append(split.delta(p, reason if i == len(pieces) - 1 else None, [i]))
        assert "".join(d.get("reasoning_content", "") for d, _, _ in out) == (reasoning or "")
        assert "".join(d.get("content", "") for d, _, _ in out) == (content or "")
        assert [f for _, f, _ in out] == [None] * (len(pieces) - 1) + [finish]
        assert [r for _, _, rs in out for r in rs] == list(range(len(pieces)))
        if not text.startswith("<think>"):  # no thinking: no reasoning tokens
            assert split.reasoning_tokens == 0
        elif "</think>" in text:
            assert 0 < split.reasoning_tokens < len(pieces) or text.endswith("</think>")


def test_thinking_off_is_all_content():
    text = "<think>\nadd\n</think>\n\nIt is 4."
    message, finish = ReasoningSplit(mode="off").message(text, "stop")
    assert message == {"role": "assistant", "content": text, "reasoning_content": None}
    split = ReasoningSplit(mode="off")
    for p in ("<think>", "x</think>", "y"):
        split.count(p, 1)
    out = [split.delta(p, None, [i]) for i, p in enumerate(("<think>", "x</think>"))]
    out.append(split.delta("y", "stop", [2]))
    assert [d for d, _, _ in out] == [
        {"content": "<think>"},
        {"content": "x</think>"},
        {"content": "y"},
    ]
    assert split.reasoning_tokens == 0
    with pytest.raises(ValueError, match="mode"):
        ReasoningSplit(mode="on")


def test_qwen3_calls_after_the_thinking_or_without_it_are_tool_calls():
    plan = AutoToolPlan("hermes", ("get_weather",))
    for text, reasoning in [("<think>\nweather\n</think>\n\n" + CALL, "\nweather\n"), (CALL, None)]:
        message, finish = ReasoningSplit(AutoToolCalls(plan), "tag").message(text, "stop")
        assert finish == "tool_calls" and message["reasoning_content"] == reasoning
        assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
        for pieces in pieces_of(text, random.Random(9)):
            out = stream(ReasoningSplit(AutoToolCalls(plan), "tag"), pieces, "stop")
            calls = [c for d, _, _ in out for c in d.get("tool_calls", [])]
            assert [c["function"]["name"] for c in calls] == ["get_weather"]
            assert "".join(d.get("reasoning_content", "") for d, _, _ in out) == (reasoning or "")


@pytest.mark.parametrize(
    "parser, kwargs, prompt, want",
    [
        (None, {"enable_thinking": False}, "<|im_start|>assistant\n", None),
        ("deepseek_r1", {"enable_thinking": False}, "<｜Assistant｜><think>\n", "open"),
        ("deepseek_r1", None, "<|im_start|>assistant\n", "open"),
        ("qwen3", None, "<|im_start|>assistant\n", "tag"),
        ("qwen3", {"enable_thinking": True}, "<|im_start|>assistant\n", "tag"),
        ("qwen3", {"enable_thinking": False}, "<|im_start|>assistant\n", "off"),
        # the template's own test is `enable_thinking is false`: only false turns it off
        ("qwen3", {"enable_thinking": "false"}, "<|im_start|>assistant\n", "tag"),
        ("qwen3", {"enable_thinking": 0}, "<|im_start|>assistant\n", "tag"),
        # the prompt closed an empty block (enable_thinking false), or opened one (Thinking-2507)
        ("qwen3", None, "<|im_start|>assistant\n<think>\n\n</think>\n\n", "off"),
        ("qwen3", None, "<|im_start|>assistant\n<think>\n", "open"),
    ],
)
def test_the_split_mode_follows_the_parser_the_kwargs_and_the_prompt(parser, kwargs, prompt, want):
    assert mode(parser, kwargs, prompt) == want


QWEN3_TEMPLATE = json.loads(
    (Path(__file__).resolve().parents[1] / "support" / "qwen3_tokenizer_config.json").read_text(
        encoding="utf-8"
    )
)["chat_template"]  # Qwen3's own (see tests/engine/test_chat_templates.py for its source)
QWEN3_REPLY = "<think>\nTwo and two.\n</think>\n\nIt is 4."


@pytest.fixture(scope="module")
def qwen3():
    backend = ScriptedReply(QWEN3_REPLY, piece=4)
    tiny = Tokenizer.tiny()
    backend.tokenizer = Tokenizer(
        tiny.backend, eos_token="<|im_end|>", chat_template=QWEN3_TEMPLATE
    )
    loop = ServerLoop()
    config = {"tenants": [{"name": "t", "api_key": KEY}], "reasoning_parser": "qwen3"}
    url = loop.serve(create_app(backend, config))
    yield backend, openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    loop.close()


def ask(client, stream: bool, **kw) -> tuple[str | None, str | None, int | None]:
    """(reasoning, content, reasoning tokens) of one reply, whole or streamed."""
    if not stream:
        out = client.chat.completions.create(model=MODEL, messages=QUESTION, **kw)
        msg = out.choices[0].message
        return (
            msg.reasoning_content,
            msg.content,
            out.usage.completion_tokens_details.reasoning_tokens,
        )
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            stream=True,
            stream_options={"include_usage": True},
            **kw,
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    thought = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    tokens = chunks[-1].usage.completion_tokens_details.reasoning_tokens
    return thought or None, content or None, tokens


@pytest.mark.parametrize("streamed", [False, True])
def test_qwen3_through_the_api(qwen3, streamed):
    backend, client = qwen3
    pieces = [QWEN3_REPLY[i : i + 4] for i in range(0, len(QWEN3_REPLY), 4)]
    thinking = next(k for k in range(len(pieces)) if "</think>" in "".join(pieces[: k + 1])) + 1
    backend.reply = QWEN3_REPLY
    assert ask(client, streamed) == ("\nTwo and two.\n", "\n\nIt is 4.", thinking)
    prompt = backend.tokenizer.decode(backend.prompts[-1], skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\n")
    # enable_thinking false: the template closes an empty block, and nothing is split
    off = {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    assert ask(client, streamed, **off) == (None, QWEN3_REPLY, 0)
    prompt = backend.tokenizer.decode(backend.prompts[-1], skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # an answer without thinking (Qwen3 did not open <think>) is content
    backend.reply = "It is 4."
    try:
        assert ask(client, streamed) == (None, "It is 4.", 0)
    finally:
        backend.reply = QWEN3_REPLY
