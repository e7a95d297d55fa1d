"""`tool_choice: "auto"`: the model writes freely; the calls it writes in its family's format come
back as OpenAI `tool_calls`, the rest as content.

The app's `tool_call_parser` names the format (vLLM's `--tool-call-parser` names the same ones):

* `hermes` (Qwen2 and Qwen2.5, Hermes, and other templates that ask for `<tool_call>` tags): each
  call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, anywhere in the output; the
  text around the calls is the content.
* `llama3_json` (Llama 3.1-3.3 JSON tool calling): the whole output is the calls, one or more
  `{"name": ..., "parameters": {...}}` objects (`arguments` is taken too) separated by `;`,
  optionally after `<|python_tag|>`; an output that does not start with `{` is content.
* `mistral` (Mistral's instruct models): the content, then `[TOOL_CALLS]` and the calls to the
  end: a JSON list of `{"name": ..., "arguments": {...}}` (tokenizers before v11, e.g.
  Mistral-7B-Instruct-v0.3), or `name[ARGS]{...}` after each `[TOOL_CALLS]` (v11 and later,
  `[CALL_ID]...` before `[ARGS]` allowed). `[TOOL_CALLS]` is a special token, so these requests
  keep special tokens in their text. Call ids are 9 letters and digits: Mistral's templates
  refuse any other id when the calls come back in the conversation.
* `pythonic` (Llama 3.2, and Llama 4 with its tool-calling system prompt): the whole output is
  one Python list of calls, `[get_weather(city="Rome"), get_time(zone="CET")]`, keyword
  arguments with literal values (strings, numbers, True/False/None, lists, dicts), optionally
  between `<|python_start|>` and `<|python_end|>`; it is parsed with `ast`, never evaluated. An
  output that does not start with `[` is content.

A block becomes calls only when each of its objects names one of the request's tools and has a
JSON object of arguments; any other block is content, as the model wrote it. The arguments are
not checked against the tool's schema (a forced call, `tool_choice: "required"` or a named
function, is enforced with a grammar instead). With `parallel_tool_calls: false` only the first
call is returned. Whitespace between the content and a call, and after the last call, is
dropped.

Streaming: content goes out as it comes, except text that may be the start of a call, which is
held until it is known; a call goes out whole, as one `delta.tool_calls` item (index, id, type,
name and all its arguments), once its block is complete. Log-probs are held with the text they
score and go out with it (or with the call it became). The whole (non-streamed) reply runs the
same code on the whole output, so the two agree.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any

from fairbatch.deployments.api.schemas import finish_reason


@dataclass(frozen=True)
class AutoToolPlan:
    """`tool_choice: "auto"` with the app's parser: which tools the calls may name."""

    parser: str
    names: tuple[str, ...]
    parallel: bool = True


@dataclass(frozen=True)
class Block:
    """Text that may hold calls: `calls` is [(name, arguments)] when it parsed as calls, else
    None (then `raw` is content)."""

    raw: str
    calls: list[tuple[str, dict]] | None


def _call(obj: Any, keys: tuple[str, ...]) -> tuple[str, dict] | None:
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
        return None
    args = next((obj[k] for k in keys if k in obj), None)
    return (obj["name"], args) if isinstance(args, dict) else None


def _json_objects(text: str, sep: str) -> list[Any] | None:
    """The JSON values of `text`, separated by `sep` and whitespace; None if it is not that."""
    decoder = json.JSONDecoder()
    out, i = [], 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        out.append(value)
        rest = text[i:].lstrip()
        if not rest:
            return out
        if not rest.startswith(sep):
            return None
        i = len(text) - len(rest) + len(sep)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a start of `tag` (held: it may be one)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def split_at(buf: str, tag: str, final: bool) -> tuple[str, str | None]:
    """(the content of `buf` that can go out, `buf` from `tag` on or None without it): an end
    that may be the start of `tag` is kept back (in neither part) unless `final`."""
    i = buf.find(tag)
    if i >= 0:
        return buf[:i], buf[i:]
    keep = 0 if final else _partial_suffix(buf, tag)
    return buf[: len(buf) - keep], None


def call_id() -> str:
    """An OpenAI-style tool call id."""
    return f"call_{secrets.token_hex(12)}"


class HermesFormat:
    START, END = "<tool_call>", "</tool_call>"
    keeps_special_tokens = False
    call_id = staticmethod(call_id)

    def __init__(self) -> None:
        self.buf = ""
        self.in_call = False

    def held(self) -> bool:
        return bool(self.buf) or self.in_call

    def feed(self, text: str, final: bool) -> list[str | Block]:
        self.buf += text
        out: list[str | Block] = []
        while True:
            if not self.in_call:
                content, rest = split_at(self.buf, self.START, final)
                if content:
                    out.append(content)
                if rest is None:
                    self.buf = self.buf[len(content) :]
                    return out
                self.buf, self.in_call = rest[len(self.START) :], True
                continue
            j = self.buf.find(self.END)
            if j < 0:
                if final:  # a call cut short (or never closed): content, as written
                    out.append(self.START + self.buf)
                    self.buf, self.in_call = "", False
                return out
            body = self.buf[:j]
            objs = _json_objects(body, ";")
            call = _call(objs[0], ("arguments",)) if objs and len(objs) == 1 else None
            raw = self.START + body + self.END
            out.append(Block(raw, None if call is None else [call]))
            self.buf, self.in_call = self.buf[j + len(self.END) :], False


class WholeOutputFormat:
    """A format whose calls are the whole output, told by how it starts: an output that starts
    (after whitespace) with `TAG` or `OPEN` is held to its end and parsed as calls (`parse`),
    any other output is content as it comes."""

    TAG, OPEN = "", ""
    keeps_special_tokens = False
    call_id = staticmethod(call_id)

    def __init__(self) -> None:
        self.buf = ""
        self.calls: bool | None = None  # None until the output's start tells

    def held(self) -> bool:
        return bool(self.buf)

    def parse(self, body: str) -> list[tuple[str, dict]] | None:
        raise NotImplementedError

    def feed(self, text: str, final: bool) -> list[str | Block]:
        if self.calls is False:
            return [text] if text else []
        self.buf += text
        head = self.buf.lstrip()
        if self.calls is None:
            if head.startswith(self.TAG) or head.startswith(self.OPEN):
                self.calls = True
            elif head and not self.TAG.startswith(head):
                self.calls = False
            elif not final:
                return []  # only whitespace, or a start of the tag, so far
        if not self.calls:
            out, self.buf, self.calls = self.buf, "", False
            return [out] if out else []
        if not final:
            return []
        raw, self.buf = self.buf, ""
        return [Block(raw, self.parse(head.removeprefix(self.TAG)))]


class Llama3JsonFormat(WholeOutputFormat):
    TAG, OPEN = "<|python_tag|>", "{"

    def parse(self, body: str) -> list[tuple[str, dict]] | None:
        objs = _json_objects(body, ";")
        calls = [_call(o, ("parameters", "arguments")) for o in objs or []]
        return calls if calls and all(c is not None for c in calls) else None


_MISTRAL_CALL = re.compile(
    r"\s*([A-Za-z0-9_-]+)(?:\[CALL_ID\][A-Za-z0-9]*)?(?:\[ARGS\])?(.*)", re.S
)
_ALNUM = string.ascii_letters + string.digits


def _mistral_calls(raw: str) -> list[tuple[str, dict]] | None:
    """The calls after `[TOOL_CALLS]` in either of Mistral's layouts, or None."""
    parts = raw.split(MistralFormat.TAG)[1:]
    if len(parts) == 1 and parts[0].lstrip().startswith("["):  # before v11: one JSON list
        objs = _json_objects(parts[0], ";")
        items = objs[0] if objs and len(objs) == 1 and isinstance(objs[0], list) else []
        calls = [_call(o, ("arguments",)) for o in items]
    else:  # v11 and later: name[ARGS]{...} after each tag
        calls = []
        for part in parts:
            m = _MISTRAL_CALL.fullmatch(part)
            objs = _json_objects(m.group(2), ";") if m else None
            ok = objs is not None and len(objs) == 1 and isinstance(objs[0], dict)
            calls.append((m.group(1), objs[0]) if ok else None)
    return calls if calls and all(c is not None for c in calls) else None


class MistralFormat:
    TAG = "[TOOL_CALLS]"
    keeps_special_tokens = True  # [TOOL_CALLS] is one

    def __init__(self) -> None:
        self.buf = ""
        self.in_calls = False

    @staticmethod
    def call_id() -> str:
        return "".join(secrets.choice(_ALNUM) for _ in range(9))

    def held(self) -> bool:
        return bool(self.buf)

    def feed(self, text: str, final: bool) -> list[str | Block]:
        self.buf += text
        out: list[str | Block] = []
        if not self.in_calls:
            content, rest = split_at(self.buf, self.TAG, final)
            if content:
                out.append(content)
            self.buf = self.buf[len(content) :]
            self.in_calls = rest is not None
        if self.in_calls and final:  # the calls run to the end of the output
            out.append(Block(self.buf, _mistral_calls(self.buf)))
            self.buf = ""
        return out


def _literal(node: ast.expr) -> Any:
    """A call argument's value: a Python literal (strings, numbers, True/False/None, lists,
    dicts, tuples as lists), as JSON takes it. Anything else raises ValueError."""
    value = ast.literal_eval(node)
    if isinstance(value, (set, frozenset, bytes, complex)):
        raise ValueError("not a JSON value")
    json.dumps(value)  # (a tuple becomes a list; a non-string dict key raises)
    if isinstance(value, dict) and not all(isinstance(k, str) for k in value):
        raise ValueError("a non-string key")
    return value


def _pythonic_calls(text: str) -> list[tuple[str, dict]] | None:
    """`[name(key=value, ...), ...]` -> [(name, arguments)], or None if it is not exactly that
    (keyword arguments only, literal values)."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
            return None
        try:
            args = {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg is not None}
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
        if len(args) != len(node.keywords):  # a **kwargs
            return None
        calls.append((node.func.id, args))
    return calls


class PythonicFormat(WholeOutputFormat):
    """Llama 3.2 and Llama 4 (vLLM's `pythonic`): the whole output is one Python list of calls,
    `[get_weather(city="Rome"), ...]`, optionally between Llama 4's `<|python_start|>` and
    `<|python_end|>`."""

    TAG, OPEN = "<|python_start|>", "["
    END = "<|python_end|>"

    def parse(self, body: str) -> list[tuple[str, dict]] | None:
        return _pythonic_calls(body.rstrip().removesuffix(self.END))


FORMATS = {
    "hermes": HermesFormat,
    "llama3_json": Llama3JsonFormat,
    "mistral": MistralFormat,
    "pythonic": PythonicFormat,
}
PARSERS = tuple(FORMATS)  # (AppConfig.tool_call_parser takes these)


class AutoToolCalls:
    """One request's output text -> content and `tool_calls` (streamed or whole)."""

    def __init__(self, plan: AutoToolPlan) -> None:
        self.plan = plan
        self.format = FORMATS[plan.parser]()
        self.calls: list[dict] = []  # the calls that went out, each with its index
        self.content: list[str] = []  # the content that went out
        self.space = ""  # whitespace at the end of the content so far, held
        self.records: list[Any] = []  # log-prob records of text still held

    def _take(self, block: Block) -> list[dict] | None:
        if block.calls is None or any(n not in self.plan.names for n, _ in block.calls):
            return None
        out = []
        for name, args in block.calls:
            if self.calls and not self.plan.parallel:
                break  # parallel_tool_calls false: the first call only
            fn = {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}
            call = {"index": len(self.calls), "id": self.format.call_id(),
                    "type": "function", "function": fn}  # fmt: skip
            self.calls.append(call)
            out.append(call)
        return out

    def _content(self, text: str) -> str:
        """What of the content `text` goes out now: its trailing whitespace is held, to go out
        with the next content or to be dropped before a call."""
        if not text.strip():
            self.space += text
            return ""
        kept = text.rstrip()
        out, self.space = self.space + kept, text[len(kept) :]
        return out

    def delta(
        self, text: str, reason: str | None, records: list[Any] | None = None
    ) -> tuple[dict, str | None, list[Any]]:
        """The chat delta, finish_reason and the log-prob records to send with it, for the
        next piece of output (`reason`: the engine's, None while it runs)."""
        final = reason is not None
        self.records.extend(records or [])
        sent, calls, content = "", [], ""
        for piece in self.format.feed(text, final):
            taken = self._take(piece) if isinstance(piece, Block) else None
            if taken is None:
                content += piece.raw if isinstance(piece, Block) else piece
                continue
            sent += self._content(content)
            content, self.space = "", ""
            calls.extend(taken)
        sent += self._content(content)
        if final and not self.calls:  # no call: the content exactly as the model wrote it
            sent, self.space = sent + self.space, ""
        if sent:
            self.content.append(sent)
        delta: dict[str, Any] = {}
        if sent:
            delta["content"] = sent
        if calls:
            delta["tool_calls"] = calls
        release = final or not (self.format.held() or self.space)
        given, self.records = (self.records, []) if release else ([], self.records)
        return delta, self._finish(reason), given

    def _finish(self, reason: str | None) -> str | None:
        if reason == "stop" and self.calls:
            return "tool_calls"
        return finish_reason(reason)

    def message(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        """The whole reply's message and finish_reason."""
        _, finish, _ = self.delta(text, reason)
        content = "".join(self.content)
        if not self.calls:
            return {"role": "assistant", "content": content}, finish
        calls = [{k: v for k, v in c.items() if k != "index"} for c in self.calls]
        return {"role": "assistant", "content": content or None, "tool_calls": calls}, finish
