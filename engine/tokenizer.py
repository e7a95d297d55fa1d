"""Text <-> token ids, and chat messages -> prompt text, for one model.

`Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust fast tokenizer every HF model ships as
`tokenizer.json`) plus the few settings from `tokenizer_config.json` / `generation_config.json`
the engine needs: BOS/EOS ids and the chat template. It deliberately does not depend on
`transformers`; it reads the files `PreTrainedTokenizerFast.save_pretrained` writes.

Decoding is the raw `tokenizers` decode: no `clean_up_tokenization_spaces`, so decoding a token
list piece by piece and as a whole agree (the incremental detokenizer relies on that).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})


class Tokenizer:
    """A fast tokenizer with its special tokens and chat template.

    Thread-safe for encode/decode (the Rust tokenizer is); construct with `from_dir`,
    `from_files` or `tiny`.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        extra_eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
    ) -> None:
        self._tok = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.bos_token_id = self._id_of(bos_token)
        eos = [] if eos_token is None else [self._id_of(eos_token)]
        # Tokenizer EOS first, then the model's extra ones (e.g. an end-of-turn token), no dups.
        self.eos_token_ids: list[int] = list(
            dict.fromkeys(i for i in [*eos, *extra_eos_token_ids] if i is not None)
        )
        self._template: jinja2.Template | None = None

    def _id_of(self, token: str | None) -> int | None:
        if token is None:
            return None
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"special token {token!r} is not in the vocabulary")
        return token_id

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def from_files(
        cls,
        tokenizer_file: str | Path,
        config_file: str | Path | None = None,
        generation_config_file: str | Path | None = None,
        chat_template: str | None = None,
    ) -> Tokenizer:
        """Load `tokenizer.json`, optionally with a tokenizer config and a generation config.

        The config supplies `bos_token`, `eos_token` (strings or HF AddedToken dicts) and a
        `chat_template` (a string, or HF's list of named templates: "default" is used) unless
        `chat_template` is given. The generation config's `eos_token_id` (int or list) adds EOS
        ids, as HF models declare end-of-turn tokens there.
        """
        config = _read_json(config_file) if config_file is not None else {}
        gen = _read_json(generation_config_file) if generation_config_file is not None else {}
        extra = gen.get("eos_token_id")
        extra_ids = [] if extra is None else [extra] if isinstance(extra, int) else list(extra)
        return cls(
            tokenizers.Tokenizer.from_file(str(tokenizer_file)),
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            extra_eos_token_ids=extra_ids,
            chat_template=chat_template
            if chat_template is not None
            else _select_template(config.get("chat_template")),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load a HF model or tokenizer directory (needs `tokenizer.json`).

        Chat template, first found: `chat_template.jinja` (transformers >= 4.43 writes it),
        `chat_template.json`, then `tokenizer_config.json`'s `chat_template`.
        """
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json (only fast tokenizers load)")
        template = None
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        elif (path / "chat_template.json").is_file():
            template = _select_template(
                _read_json(path / "chat_template.json").get("chat_template")
            )

        def optional(name: str) -> Path | None:
            return path / name if (path / name).is_file() else None

        return cls.from_files(
            path / "tokenizer.json",
            optional("tokenizer_config.json"),
            optional("generation_config.json"),
            chat_template=template,
        )

    @classmethod
    def tiny(cls) -> Tokenizer:
        """The 2048-token byte-level BPE shipped in `engine/assets/` (ChatML template)."""
        return cls.from_files(
            ASSETS_DIR / "tiny_tokenizer.json",
            ASSETS_DIR / "tiny_tokenizer_config.json",
            ASSETS_DIR / "tiny_generation_config.json",
        )

    def save_pretrained(self, path: str | Path) -> None:
        """Write `tokenizer.json` and `tokenizer_config.json` in the HF layout into `path`.

        EOS ids beyond `eos_token` are a model setting: write them in the model's
        `generation_config.json` (see `engine/assets/tiny_generation_config.json`).
        """
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(path / "tokenizer.json"), pretty=False)
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
        if self.bos_token is not None:
            config["bos_token"] = self.bos_token
        if self.eos_token is not None:
            config["eos_token"] = self.eos_token
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")

    # -- ids and text -----------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids, added/special tokens included (the model's vocab may be larger)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped `tokenizers.Tokenizer`."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies the post-processor (e.g. BOS).

        Special-token strings inside `text` become special tokens (the `tokenizers` default).
        """
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; incomplete UTF-8 at the end shows as U+FFFD."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        """Vocabulary strings of `ids` (None for ids outside the vocabulary)."""
        return [self._tok.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    # -- chat -------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render `messages` ([{"role", "content"}, ...]) into prompt text.

        Roles: system, user, assistant, tool. Content: a string, or OpenAI-style text parts
        ([{"type": "text", "text": ...}]), joined. Anything else raises ValueError, as does an
        error raised by the template itself (`raise_exception`). Templates that render the
        BOS token (the tiny one does, like Llama-3's) want the result encoded with
        `add_special_tokens=False`. Extra `kwargs` are passed to the template.
        """
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if isinstance(messages, (str, bytes)) or not messages:
            raise ValueError("messages must be a non-empty list of {role, content} dicts")
        clean = [_check_message(i, m) for i, m in enumerate(messages)]
        if self._template is None:
            self._template = _jinja_env().from_string(self.chat_template)
        return self._template.render(
            messages=clean,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
            f"eos={self.eos_token_ids}, chat_template={self.chat_template is not None})"
        )


def _check_message(index: int, message: Any) -> dict[str, Any]:
    """A validated copy of one chat message, with text-part content joined into a string."""
    if not isinstance(message, Mapping):
        raise ValueError(f"messages[{index}] must be a dict, got {type(message).__name__}")
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise ValueError(f"messages[{index}] has unknown role {role!r}; use {sorted(CHAT_ROLES)}")
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, Mapping) and part.get("type") == "text"):
                raise ValueError(f"messages[{index}]: only text content parts are supported")
            parts.append(str(part.get("text", "")))
        content = "".join(parts)
    if not isinstance(content, str):
        raise ValueError(f"messages[{index}] ({role}) is missing its string content")
    return {**message, "content": content}


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template error: {message}")


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # HF's override of jinja's tojson: no HTML escaping, non-ASCII kept.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _GenerationTag(jinja2.ext.Extension):
    """HF's `{% generation %}...{% endgeneration %}` marks assistant text for training masks;
    templates that use it must parse, and here the tag just renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    # The settings HF's apply_chat_template uses, so third-party templates render identically;
    # sandboxed because templates come with downloaded checkpoints.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)  # Llama-3.1 uses it
    env.filters["tojson"] = _tojson
    return env


def _read_json(path: str | Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_content(token: Any) -> str | None:
    """A special token from a HF config: a plain string or an AddedToken dict."""
    if token is None or isinstance(token, str):
        return token
    if isinstance(token, Mapping) and isinstance(token.get("content"), str):
        return token["content"]
    raise ValueError(f"cannot read special token {token!r}")


def _select_template(template: Any) -> str | None:
    """HF stores one template string, or a list of {"name", "template"}: take "default"."""
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        return named.get("default")
    raise ValueError(f"cannot read chat_template of type {type(template).__name__}")
