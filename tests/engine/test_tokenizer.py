"""Tokenizer: the shipped tiny tokenizer, training, round trips, chat templates, HF dirs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from chat_fixtures import hf_tiny_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st

from fairbatch.engine import train_tokenizer
from fairbatch.engine.tokenizer import ASSETS_DIR, Tokenizer

SAMPLES = [
    "Hello, world! The scheduler preempts a request.",
    "def f(x: int) -> int:\n    return x + 1\n",
    "café, naïve, crème brûlée",
    "中文：推理服务器 日本語 한국어",
    "emoji 🚀🐢✅ and a family 👨‍👩‍👧 and flags 🇫🇷",
    "  leading and trailing spaces \t\n",
    "",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.tiny()


def test_tiny_special_tokens(tok: Tokenizer) -> None:
    assert tok.vocab_size == 2048
    assert tok.convert_ids_to_tokens([0, 1, 2, 3]) == [
        "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>",
    ]  # fmt: skip
    assert tok.bos_token_id == 0
    assert tok.eos_token_ids == [1, 3]  # end of text, then end of turn (generation config)
    assert tok.convert_ids_to_tokens([10**6]) == [None]


def test_encode_adds_bos_only_when_asked(tok: Tokenizer) -> None:
    with_bos = tok.encode("hello")
    assert with_bos[0] == tok.bos_token_id
    assert with_bos[1:] == tok.encode("hello", add_special_tokens=False)
    assert tok.bos_token_id not in tok.encode("hello", add_special_tokens=False)


def test_tiny_tokenizer_learned_words(tok: Tokenizer) -> None:
    # A sane BPE packs common words into single tokens, not bytes.
    assert len(tok.encode(" the scheduler", add_special_tokens=False)) == 2
    assert len(tok.encode("The request", add_special_tokens=False)) <= 3


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip_samples(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == "<|begin_of_text|>" + text


def test_multibyte_characters_split_into_several_tokens(tok: Tokenizer) -> None:
    # The detokenizer tests rely on this: byte-level tokens that end inside a character.
    ids = tok.encode("🐢", add_special_tokens=False)
    assert len(ids) >= 2
    assert tok.decode(ids[:1]).endswith("\ufffd")


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_round_trip_any_text(text: str) -> None:
    tok = Tokenizer.tiny()
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_skipped_on_decode(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert ids[0] == 2 and ids[-1] == 3
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


# -- training ---------------------------------------------------------------------------------


def test_training_is_deterministic_and_reproduces_shipped_assets(tmp_path: Path) -> None:
    train_tokenizer.write_assets(tmp_path, [train_tokenizer.CORPUS])
    for name in (
        "tiny_tokenizer.json",
        "tiny_tokenizer_config.json",
        "tiny_generation_config.json",
    ):
        assert (tmp_path / name).read_bytes() == (ASSETS_DIR / name).read_bytes(), name
    assert (ASSETS_DIR / "tiny_tokenizer.json").stat().st_size <= 1_000_000
    assert train_tokenizer.CORPUS.stat().st_size <= 300_000


def test_train_small_vocab_round_trip() -> None:
    texts = ["the cat sat on the mat", "the dog sat on the log", "über café 🚀"] * 3
    a = train_tokenizer.build_tokenizer(texts, vocab_size=300)
    b = train_tokenizer.build_tokenizer(texts, vocab_size=300)
    assert a.to_str() == b.to_str()
    tok = Tokenizer(a, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")
    assert tok.vocab_size <= 300
    for text in ["the cat sat", "a new word: zebra!", "über 🚀 中文"]:
        assert tok.decode(tok.encode(text)) == text


def test_train_script_runs_as_module(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    cmd = [sys.executable, "-m", "fairbatch.engine.train_tokenizer", "--out-dir", str(tmp_path),
           "--vocab-size", "512"]  # fmt: skip
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=120)
    tok = Tokenizer.from_files(
        tmp_path / "tiny_tokenizer.json", tmp_path / "tiny_tokenizer_config.json"
    )
    assert tok.vocab_size == 512 and tok.decode(tok.encode("schedule")) == "schedule"


# -- chat template ----------------------------------------------------------------------------


def test_chat_template_chatml(tok: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 🚀"},
        {"role": "assistant", "content": "Hello."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Why"}, {"type": "text", "text": "?"}],
        },
    ]
    want = (
        "<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi 🚀<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nWhy?<|im_end|>\n"
    )
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == want
    prompt = tok.apply_chat_template(messages)
    assert prompt == want + "<|im_start|>assistant\n"
    ids = tok.encode(prompt, add_special_tokens=False)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert ids.count(2) == 5 and ids.count(3) == 4


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([{"role": "wizard", "content": "x"}], "unknown role"),
        ([{"content": "x"}], "unknown role"),
        ([{"role": "user"}], "missing"),
        ([{"role": "user", "content": None}], "missing"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "text content"),
        (["hello"], "must be a dict"),
        ([], "non-empty"),
        ("hello", "non-empty"),
    ],
)
def test_chat_template_rejects_bad_messages(tok: Tokenizer, messages, match: str) -> None:
    # A template that checks nothing itself: the validation under test is the wrapper's.
    permissive = Tokenizer(tok.backend, chat_template="{{ messages | length }}")
    with pytest.raises(ValueError, match=match):
        permissive.apply_chat_template(messages)
    with pytest.raises(ValueError, match=match):
        tok.apply_chat_template(messages)


def test_chat_template_errors_and_sandbox(tok: Tokenizer) -> None:
    raising = Tokenizer(tok.backend, chat_template="{{ raise_exception('no system') }}")
    with pytest.raises(ValueError, match="no system"):
        raising.apply_chat_template([{"role": "user", "content": "x"}])
    sneaky = Tokenizer(tok.backend, chat_template="{{ messages.append(1) }}")
    with pytest.raises(Exception, match="unsafe|immutable|not safely|SecurityError|access"):
        sneaky.apply_chat_template([{"role": "user", "content": "x"}])
    hf_extras = Tokenizer(
        tok.backend,
        chat_template="{% for m in messages %}"
        "{% generation %}{{ m['content'] }}{% endgeneration %}"
        "{% if loop.first %}{% break %}{% endif %}{% endfor %}"
        "|{{ messages[0] | tojson(sort_keys=True) }}|{{ strftime_now('%Y') | length }}",
    )
    msgs = [{"role": "user", "content": "é"}, {"role": "user", "content": "second"}]
    assert hf_extras.apply_chat_template(msgs) == 'é|{"content": "é", "role": "user"}|4'
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(tok.backend).apply_chat_template([{"role": "user", "content": "x"}])


# -- HF directories ---------------------------------------------------------------------------


def test_loads_dir_saved_by_transformers(tmp_path: Path, tok: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    # Block tags on their own indented lines: renders the same only with HF's jinja settings
    # (trim_blocks, lstrip_blocks).
    template = (
        "{% for m in messages %}\n"
        "    {% if m['role'] == 'user' %}\n"
        "[{{ m['role'] }}] {{ m['content'] | tojson }}\n"
        "    {% else %}\n"
        "[{{ m['role'] }}] {{ m['content'] }}\n"
        "    {% endif %}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    hf = hf_tiny_tokenizer(template)
    hf.save_pretrained(tmp_path)
    transformers.GenerationConfig(bos_token_id=0, eos_token_id=[1, 3]).save_pretrained(tmp_path)

    ours = Tokenizer.from_dir(tmp_path)
    assert ours.bos_token_id == 0 and ours.eos_token_ids == [1, 3]
    for text in SAMPLES:
        assert ours.encode(text) == hf(text)["input_ids"]
        ids = hf(text)["input_ids"]
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    msgs = [{"role": "user", "content": "hi 中文"}, {"role": "assistant", "content": "yo"}]
    rendered = ours.apply_chat_template(msgs)
    assert rendered == '[user] "hi 中文"\n[assistant] yo\n[assistant] '
    assert rendered == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_our_save_pretrained_loads_in_transformers(tmp_path: Path, tok: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    tok.save_pretrained(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u 中文"}]
    assert hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        tok.apply_chat_template(msgs)
    )
    for text in SAMPLES:
        assert hf(text)["input_ids"] == tok.encode(text)
    again = Tokenizer.from_dir(tmp_path)
    assert again.eos_token_ids == [1]  # no generation_config.json: the tokenizer's EOS only
    assert again.chat_template == tok.chat_template


def test_from_files_reads_hf_config_variants(tmp_path: Path) -> None:
    config = {
        "bos_token": {"content": "<|begin_of_text|>", "lstrip": False, "special": True},
        "eos_token": {"content": "<|im_end|>"},
        "chat_template": [
            {"name": "tool_use", "template": "TOOLS"},
            {"name": "default", "template": "DEFAULT{{ messages | length }}"},
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    (tmp_path / "tokenizer.json").write_bytes((ASSETS_DIR / "tiny_tokenizer.json").read_bytes())
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.bos_token_id == 0 and tok.eos_token_ids == [3, 1]
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "DEFAULT1"
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "JSON"}))
    assert Tokenizer.from_dir(tmp_path).chat_template == "JSON"
    (tmp_path / "chat_template.jinja").write_text("JINJA")
    assert Tokenizer.from_dir(tmp_path).chat_template == "JINJA"


def test_from_dir_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((ASSETS_DIR / "tiny_tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(ValueError, match="not in the vocabulary"):
        Tokenizer.from_dir(tmp_path)
