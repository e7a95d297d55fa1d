"""`response_format` and forced tool calls: request fields -> a grammar, output -> `tool_calls`.

What is served (OpenAI's request shapes):

* `response_format`: `{"type": "text"}` (nothing to do), `{"type": "json_object"}` (any JSON
  object), `{"type": "json_schema", "json_schema": {"name", "schema", "strict",
  "description"}}` (JSON valid against `schema`), on chat and completions. The schema is
  enforced whatever `strict` says.
* chat `tools` with `tool_choice`: `"required"` or a named function (`{"type": "function",
  "function": {"name": ...}}`) force one tool call whose arguments match the function's
  `parameters`; `"none"` ignores the tools (plain text); `"auto"` (OpenAI's default when tools
  are given) lets the model write freely and parses the calls it writes in the format the app's
  `tool_call_parser` names (deployments/api/tool_parsers.py; without one, 400). A named
  function's output is its arguments object.
  With `"required"` the output is `{"name": <tool>, "arguments": <its arguments>}`, one JSON
  schema branch per tool (`anyOf`, each `name` a `const`), so the grammar picks the tool and
  then its arguments; the reply is one call either way.
* A schema xgrammar cannot turn into a grammar is a 400 carrying xgrammar's message.

Replies: a call that ended with "stop" comes back as the message's `tool_calls` with
`finish_reason: "tool_calls"` and `content: null`; streamed as OpenAI streams calls, the first
`delta.tool_calls` item carries `index`, `id`, `type` and the function's name, the next ones
fragments of `arguments`. A call cut short (`max_tokens`) is returned as plain content with
`finish_reason: "length"`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from fairbatch.deployments.api.reasoning import ReasoningSplit
from fairbatch.deployments.api.schemas import bad_request
from fairbatch.deployments.api.tool_parsers import (
    FORMATS,
    PARSERS,
    AutoToolCalls,
    AutoToolPlan,
    call_id,
)
from fairbatch.engine.structured import GrammarSpec, schema_error

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's function and schema names
# the start of a "required" call's output, up to its arguments (the layout is fixed: see
# engine/structured.py, any_whitespace=False)
_CALL_HEAD = re.compile(r'^\{"name": "([A-Za-z0-9_-]+)", "arguments": ')
_NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """A forced tool call: `named` (the output is that function's arguments) or any of
    `names` (the output is `{"name": ..., "arguments": ...}`)."""

    names: tuple[str, ...]
    named: str | None = None


@dataclass(frozen=True)
class ChatPlan:
    grammar: GrammarSpec | None = None
    tools: ToolPlan | AutoToolPlan | None = None
    # the output's thinking is split off, in this mode (deployments/api/reasoning.py); None: not
    reasoning: str | None = None

    def converter(self) -> Any:
        """A fresh converter of one output into the reply's message (None: plain content)."""
        out = tool_stream(self.tools) if self.tools is not None else None
        return ReasoningSplit(out, self.reasoning) if self.reasoning is not None else out


def _checked(spec: GrammarSpec, param: str) -> GrammarSpec:
    error = schema_error(spec.json_schema)
    if error is not None:
        raise bad_request(f"the JSON schema cannot be used: {error}", param, "invalid_schema")
    return spec


def response_format_grammar(fmt: dict[str, Any] | None) -> GrammarSpec | None:
    """The grammar of a `response_format` (None for text or none)."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec.json_object()
    if kind != "json_schema":
        raise bad_request(
            "response_format.type must be 'text', 'json_object' or 'json_schema'",
            "response_format",
        )
    spec = fmt.get("json_schema")
    param = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise bad_request("response_format json_schema needs a 'json_schema' object", param)
    unknown = set(spec) - {"name", "schema", "strict", "description"}
    if unknown:
        raise bad_request(f"unknown json_schema fields: {', '.join(sorted(unknown))}", param)
    if not (isinstance(spec.get("name"), str) and _NAME.match(spec["name"])):
        raise bad_request("json_schema.name must match ^[a-zA-Z0-9_-]{1,64}$", param)
    if not isinstance(spec.get("schema"), dict):
        raise bad_request("json_schema.schema must be a JSON schema object", param)
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise bad_request("json_schema.strict must be a boolean", param)
    return _checked(GrammarSpec.from_schema(spec["schema"]), param)


def _functions(tools: list[Any]) -> dict[str, dict]:
    """{name: parameters schema} of the request's tools, checked."""
    out: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        param = f"tools.{i}"
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(fn, dict)):
            raise bad_request(
                f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", param
            )
        name = fn.get("name")
        if not (isinstance(name, str) and _NAME.match(name)):
            raise bad_request(
                f"tools[{i}].function.name must match ^[a-zA-Z0-9_-]{{1,64}}$",
                f"{param}.function.name",
            )
        if name in out:
            raise bad_request(f"two tools are named {name!r}", f"{param}.function.name")
        parameters = fn.get("parameters", _NO_PARAMETERS)
        if not isinstance(parameters, dict):
            raise bad_request(
                f"tools[{i}].function.parameters must be a JSON schema",
                f"{param}.function.parameters",
            )
        out[name] = parameters
    return out


def tool_plan(
    tools: list[Any] | None,
    tool_choice: Any,
    parser: str | None = None,
    parallel: bool | None = None,
) -> tuple[GrammarSpec | None, ToolPlan | AutoToolPlan] | None:
    """The grammar and plan of the tools (a forced call, or "auto" with the app's `parser`),
    or None when the tools are not used."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return None
    if not tools:
        raise bad_request("tool_choice needs tools", "tool_choice")
    functions = _functions(tools)
    if tool_choice == "auto":
        if parser is None:
            raise bad_request(
                "tool_choice 'auto' needs the app's tool_call_parser (one of "
                f"{', '.join(PARSERS)}, the model's call format): set it in the app config, "
                "or set tool_choice to 'required', a named function or 'none'",
                "tool_choice",
                "tool_choice_not_supported",
            )
        return None, AutoToolPlan(parser, tuple(functions), parallel is not False)
    if tool_choice == "required":
        branches = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": parameters},
                "required": ["name", "arguments"],
            }
            for name, parameters in functions.items()
        ]
        spec = GrammarSpec.from_schema({"anyOf": branches})
        return _checked(spec, "tools"), ToolPlan(tuple(functions))
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not (isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and name):
        raise bad_request(
            "tool_choice must be 'none', 'auto', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}",
            "tool_choice",
        )
    if name not in functions:
        raise bad_request(f"tool_choice names {name!r}, not one of the tools", "tool_choice")
    spec = GrammarSpec.from_schema(functions[name])
    return _checked(spec, "tools"), ToolPlan((name,), name)


async def chat_plan(body: Any, parser: str | None = None, reasoning: str | None = None) -> ChatPlan:
    """The grammar and tool plan of a chat request (`parser`: the app's tool_call_parser;
    `reasoning`: the reasoning split's mode, `reasoning.mode`, None without a parser); a forced
    call wins over a response_format, and a grammar turns the reasoning split off. Runs off the
    event loop: the first use imports xgrammar."""

    def plan() -> ChatPlan:
        used = tool_plan(body.tools, body.tool_choice, parser, body.parallel_tool_calls)
        if used is None:
            return ChatPlan(response_format_grammar(body.response_format))
        if isinstance(used[1], AutoToolPlan) and response_format_grammar(body.response_format):
            raise bad_request(
                "response_format cannot be combined with tool_choice 'auto' (the format would "
                "keep the model from writing a call)",
                "response_format",
            )
        return ChatPlan(*used)

    got = ChatPlan()
    if not (body.response_format is None and body.tools is None and body.tool_choice is None):
        got = await asyncio.to_thread(plan)
    if reasoning is not None and got.grammar is None:
        got = dataclasses.replace(got, reasoning=reasoning)
    return got


async def completion_grammar(body: Any) -> GrammarSpec | None:
    if body.response_format is None:
        return None
    return await asyncio.to_thread(response_format_grammar, body.response_format)


def with_grammar(params: Any, grammar: GrammarSpec | None) -> Any:
    """`params` (SamplingParams) with the grammar set, if there is one."""
    if grammar is None:
        return params
    return dataclasses.replace(params, structured_output=grammar)


def with_plan(params: Any, plan: ChatPlan) -> Any:
    """`params` with the chat plan's grammar, and with special tokens kept in the text when the
    tool-call format is written with some (Mistral's `[TOOL_CALLS]`)."""
    params = with_grammar(params, plan.grammar)
    tools = plan.tools
    if isinstance(tools, AutoToolPlan) and FORMATS[tools.parser].keeps_special_tokens:
        params = dataclasses.replace(params, skip_special_tokens=False)
    return params


class ToolCallStream:
    """One forced call's output text -> OpenAI `tool_calls` (streamed or whole)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.id = call_id()
        self.name = plan.named  # known from the start for a named function
        self.head = 0 if plan.named else None  # where the arguments start in the output
        self.text = ""  # the output so far
        self.arguments = ""  # the arguments sent so far
        self.started = False  # the call's first item (id, name) went out

    def delta(
        self, text: str, reason: str | None, records: list[Any] | None = None
    ) -> tuple[dict, str | None, list[Any]]:
        """The chat delta, finish_reason and log-prob records (`records`, sent as they come)
        for the next piece of output (`reason`: the engine's, None while it runs)."""
        self.text += text
        if self.head is None:
            m = _CALL_HEAD.match(self.text)
            if m is not None:
                self.name, self.head = m.group(1), m.end()
        items: list[dict] = []
        if self.head is not None:
            if not self.started:
                self.started = True
                items.append(
                    {"index": 0, "id": self.id, "type": "function",
                     "function": {"name": self.name, "arguments": ""}}
                )  # fmt: skip
            rest = self.text[self.head + len(self.arguments) :]
            if self.plan.named is None:  # the wrapper's closing "}" is not the arguments'
                if reason is None:
                    rest = rest[:-1]  # (held: it may be that "}")
                elif _is_json(self.text):  # the wrapper closed
                    rest = rest.rstrip()[:-1]
            if rest:
                self.arguments += rest
                if items:  # the call's first item carries its first arguments too
                    items[0]["function"]["arguments"] = rest
                else:
                    items.append({"index": 0, "function": {"arguments": rest}})
        finish = None if reason is None else self._finish_reason(reason)
        if finish is not None and not self.started:  # no call came out of it: plain text
            return ({"content": self.text} if self.text else {}), finish, records or []
        return ({"tool_calls": items} if items else {}), finish, records or []

    def _finish_reason(self, reason: str) -> str:
        if reason in ("length", "timeout"):  # cut short: the call so far, as OpenAI sends it
            return reason
        return "tool_calls" if reason == "stop" and self.complete() else "stop"

    def complete(self) -> bool:
        return self.name is not None and _is_json(self.arguments)

    def message(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        """The whole reply's message and finish_reason: what the streamed deltas add up to (the
        call, whole or cut short, once its name is known; plain content before that)."""
        _, finish, _ = self.delta(text, reason)
        if not self.started:
            return {"role": "assistant", "content": self.text}, finish
        call = {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip
        return {"role": "assistant", "content": None, "tool_calls": [call]}, finish


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def tool_stream(plan: ToolPlan | AutoToolPlan) -> ToolCallStream | AutoToolCalls:
    """The output converter of one request's tool plan."""
    return AutoToolCalls(plan) if isinstance(plan, AutoToolPlan) else ToolCallStream(plan)
