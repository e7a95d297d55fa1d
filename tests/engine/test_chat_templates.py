"""Real chat templates render exactly as transformers' `apply_chat_template` renders them.

The templates are the models' own, kept in tests/support/ with the special tokens of the
tokenizer_config.json they ship in (no downloads here):

* qwen3_tokenizer_config.json: Qwen3's `chat_template` (Qwen/Qwen3-8B, tokenizer_config.json
  line 230, the version with `enable_thinking` and `message.content is string`), as quoted
  verbatim in guidance-ai/guidance's chat template table (its `qwen3_it_template`); bos null,
  eos `<|im_end|>`, pad `<|endoftext|>` as Qwen3 ships them.
* gemma3_tokenizer_config.json: Gemma 3's `chat_template` and special tokens (`<bos>`, `<eos>`,
  `<pad>`, `<unk>`) from google/gemma-3-*-it's tokenizer_config.json, as quoted verbatim in the
  Berkeley Function Calling Leaderboard's Gemma handler (gorilla, bfcl
  model_handler/local_inference/gemma.py). No system role: the system message folds into the
  first user turn; roles must alternate; the template writes `<bos>` itself.

Each is saved beside the tiny tokenizer (with the template's special tokens added, and for
Gemma a post-processor that adds `<bos>` as Gemma's tokenizer.json does) and loaded by both
`Tokenizer.from_dir` and `transformers.AutoTokenizer`; the renders are compared string for
string, over system + user, multi-turn, and Qwen3's `enable_thinking` true, false and unset.
Then through the API: `chat_template_kwargs` reach the render, and a Gemma prompt is encoded
with one `<bos>`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import openai
import pytest
import tokenizers
from chat_fixtures import WEATHER, ScriptedReply
from loopback import ServerLoop
from tokenizers.processors import TemplateProcessing

from fairbatch.deployments.api.backend import create_app
from fairbatch.engine.tokenizer import ASSETS_DIR, Tokenizer

transformers = pytest.importorskip("transformers")

SUPPORT = Path(__file__).resolve().parents[1] / "support"
KEY = "key-templates"
MODEL = "fairbatch-tiny"

QWEN3_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN3_TEXT_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]  # not special
GEMMA3_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]

SYSTEM_USER = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 2?"},
]
MULTI_TURN = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "  What is 2 + 2?\n"},
    {"role": "assistant", "content": "It is 4."},
    {"role": "user", "content": "And 3 + 3?"},
]
# Qwen3 only: an earlier answer with its thinking in the text, another with reasoning_content
THOUGHTS = [
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nIt is 4."},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "content": "It is 6.", "reasoning_content": "add again"},
    {"role": "user", "content": "Thanks"},
]
TOOL_USE = [
    {"role": "user", "content": "Weather in Rome?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Rome"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


def model_dir(path: Path, config_name: str, special: list[str], text: list[str] = ()) -> Path:
    """A tokenizer directory: the tiny tokenizer plus the template's tokens, and the fixture's
    tokenizer_config.json (loaded as a fast tokenizer from tokenizer.json)."""
    config = json.loads((SUPPORT / config_name).read_text(encoding="utf-8"))
    tok = tokenizers.Tokenizer.from_file(str(ASSETS_DIR / "tiny_tokenizer.json"))
    tok.add_special_tokens(special)
    tok.add_tokens(list(text))
    bos = config.get("bos_token")
    if bos is not None:  # Gemma's tokenizer.json adds <bos> to every encoded text
        tok.post_processor = TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tok.token_to_id(bos))],
        )
    else:
        tok.post_processor = None
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # (the template does not depend on it)
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qwen3")
    return model_dir(path, "qwen3_tokenizer_config.json", QWEN3_TOKENS, QWEN3_TEXT_TOKENS)


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory) -> Path:
    return model_dir(
        tmp_path_factory.mktemp("gemma3"), "gemma3_tokenizer_config.json", GEMMA3_TOKENS
    )


def both(path: Path):
    return Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(path)


def hf_render(hf, messages, **kwargs) -> str:
    return hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


@pytest.mark.parametrize("messages", [SYSTEM_USER, MULTI_TURN, THOUGHTS, TOOL_USE])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": True}, {"enable_thinking": False}])
def test_qwen3_renders_as_transformers_does(qwen3_dir, messages, kwargs):
    ours, hf = both(qwen3_dir)
    tools = [WEATHER] if messages is TOOL_USE else None
    got = ours.apply_chat_template(messages, tools=tools, **kwargs)
    assert got == hf_render(hf, messages, tools=tools, **kwargs)
    # the thinking switch: false closes an empty think block after the generation prompt
    closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert got.endswith(closed) == (kwargs.get("enable_thinking") is False)
    assert got.endswith(
        "<|im_start|>assistant\n" if kwargs.get("enable_thinking") is not False else closed
    )


@pytest.mark.parametrize("config", ["qwen3_tokenizer_config.json", "gemma3_tokenizer_config.json"])
def test_text_parts_are_joined_before_the_render(tmp_path, config):
    # Deliberately unlike transformers, which hands the list to the template (Qwen3's renders a
    # list as ''; the text is lost): the parts are joined into the string content first, as
    # vLLM does for templates that take string content. The render is transformers' on that.
    tokens = QWEN3_TOKENS if config.startswith("qwen3") else GEMMA3_TOKENS
    ours, hf = both(model_dir(tmp_path, config, tokens))
    parts = [{"type": "text", "text": "And 3 "}, {"type": "text", "text": "+ 3?"}]
    messages = [*MULTI_TURN[:-1], {"role": "user", "content": parts}]
    assert ours.apply_chat_template(messages) == hf_render(hf, MULTI_TURN)


def test_qwen3_keeps_only_the_last_turns_thinking(qwen3_dir):
    ours, hf = both(qwen3_dir)
    last = [*THOUGHTS[:-1]]  # ends with the assistant's reply that carries reasoning_content
    for messages in (THOUGHTS, last):
        assert ours.apply_chat_template(messages) == hf_render(hf, messages)
    text = ours.apply_chat_template(THOUGHTS)
    assert "add them" not in text and "add again" not in text  # earlier turns: answers only
    assert "<think>\nadd again\n</think>\n\nIt is 6." in ours.apply_chat_template(last)


@pytest.mark.parametrize(
    "messages",
    [
        SYSTEM_USER,
        MULTI_TURN,
        [{"role": "user", "content": "Hi"}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " Hello \n"}],
    ],
)
def test_gemma3_renders_as_transformers_does(gemma3_dir, messages):
    ours, hf = both(gemma3_dir)
    got = ours.apply_chat_template(messages)
    assert got == hf_render(hf, messages)
    assert got.startswith("<bos><start_of_turn>user\n") and got.endswith("<start_of_turn>model\n")
    if messages[0]["role"] == "system":  # no system turn: it opens the first user turn
        assert "<start_of_turn>system" not in got
        assert got.startswith("<bos><start_of_turn>user\nYou are terse.\n\nWhat is 2 + 2?")


def test_gemma3_refuses_what_transformers_refuses(gemma3_dir):
    ours, hf = both(gemma3_dir)
    twice = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(Exception, match="alternate"):
        hf_render(hf, twice)
    with pytest.raises(ValueError, match="alternate"):
        ours.apply_chat_template(twice)


def test_gemma3_prompt_ids_match_transformers_with_one_bos(gemma3_dir):
    ours, hf = both(gemma3_dir)
    text = ours.apply_chat_template(SYSTEM_USER)
    out = hf.apply_chat_template(SYSTEM_USER, tokenize=True, add_generation_prompt=True)
    hf_ids = list(out["input_ids"] if isinstance(out, Mapping) else out)
    assert ours.encode(text, add_special_tokens=False) == hf_ids
    assert hf_ids.count(ours.bos_token_id) == 1
    assert ours.encode(text).count(ours.bos_token_id) == 2  # what encoding it plainly would do


# ---- through the API ----------------------------------------------------------------------------


def serve(backend, **config):
    loop = ServerLoop()
    url = loop.serve(create_app(backend, {"tenants": [{"name": "t", "api_key": KEY}], **config}))
    return loop, openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=30)


def test_the_api_renders_gemma3_with_one_bos(gemma3_dir):
    backend = ScriptedReply("It is 4.")
    backend.tokenizer = Tokenizer.from_dir(gemma3_dir)
    _, hf = both(gemma3_dir)
    loop, client = serve(backend)
    try:
        out = client.chat.completions.create(model=MODEL, messages=SYSTEM_USER)
        assert out.choices[0].message.content == "It is 4."
        out = hf.apply_chat_template(SYSTEM_USER, tokenize=True, add_generation_prompt=True)
        assert backend.prompts[-1] == list(out["input_ids"] if isinstance(out, Mapping) else out)
    finally:
        loop.close()


def test_chat_template_kwargs_reach_the_render(qwen3_dir):
    backend = ScriptedReply("It is 4.")
    backend.tokenizer = Tokenizer.from_dir(qwen3_dir)
    _, hf = both(qwen3_dir)
    loop, client = serve(backend)
    try:
        for kwargs in ({"enable_thinking": False}, {"enable_thinking": True}, None):
            extra = {} if kwargs is None else {"chat_template_kwargs": kwargs}
            client.chat.completions.create(model=MODEL, messages=SYSTEM_USER, extra_body=extra)
            prompt = backend.tokenizer.decode(backend.prompts[-1], skip_special_tokens=False)
            assert prompt == hf_render(hf, SYSTEM_USER, **(kwargs or {}))
        # any JSON value goes to the template, used or not
        extra = {"chat_template_kwargs": {"unused": [1, {"a": None}], "enable_thinking": False}}
        client.chat.completions.create(model=MODEL, messages=SYSTEM_USER, extra_body=extra)
        prompt = backend.tokenizer.decode(backend.prompts[-1], skip_special_tokens=False)
        assert prompt.endswith("<think>\n\n</think>\n\n")
        sent = len(backend.prompts)
        for bad, says in [
            ("yes", "chat_template_kwargs"),
            ([1], "chat_template_kwargs"),
            ({"messages": []}, "messages"),
            (
                {"add_generation_prompt": False, "bos_token": "x"},
                "add_generation_prompt, bos_token",
            ),
        ]:
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(
                    model=MODEL, messages=SYSTEM_USER, extra_body={"chat_template_kwargs": bad}
                )
            assert (
                e.value.body["param"] == "chat_template_kwargs" and says in e.value.body["message"]
            )
        assert len(backend.prompts) == sent  # nothing reached the backend
    finally:
        loop.close()


def test_the_handle_api_passes_chat_template_kwargs(qwen3_dir):
    import asyncio

    from fairbatch.deployments.serve.handle_api import HandleApi, parse_request

    backend = ScriptedReply("It is 4.")
    backend.tokenizer = Tokenizer.from_dir(qwen3_dir)
    _, hf = both(qwen3_dir)

    class Ingress(HandleApi):
        api_app = create_app(backend, {"tenants": [{"name": "t", "api_key": KEY}]})

    call = {"messages": SYSTEM_USER, "tenant": "t", "max_tokens": 8}
    for kwargs in ({"enable_thinking": False}, None):
        out = asyncio.run(Ingress().complete({**call, "chat_template_kwargs": kwargs}))
        assert out["text"] == "It is 4."
        prompt = backend.tokenizer.decode(backend.prompts[-1], skip_special_tokens=False)
        assert prompt == hf_render(hf, SYSTEM_USER, **(kwargs or {}))
    for bad, says in [
        ({**call, "chat_template_kwargs": {"messages": []}}, "cannot set messages"),
        ({**call, "chat_template_kwargs": "x"}, "chat_template_kwargs"),
        ({"prompt": "hi", "chat_template_kwargs": {"enable_thinking": False}}, "with messages"),
    ]:
        with pytest.raises(ValueError, match=says):
            parse_request(bad, {})
