"""OpenAI's Responses API (`POST /v1/responses`), served through the chat path.

A Responses request is translated into the Chat Completions body it asks for
(`ResponsesRequest.chat_body`): `instructions` becomes a system message; `input` (a string, or
message, `function_call` and `function_call_output` items) becomes the messages; `tools`
(function tools), `tool_choice`, `text.format` (text, json_object, json_schema) and
`max_output_tokens` map to their chat fields. From there it is a chat request like any other:
the same template, admission, grammar, tool-call and reasoning parsers. `ResponseBuilder`
turns the chat reply back into a `response` object: a `reasoning` item for the thinking a
reasoning parser split off, a `message` item for the content, a `function_call` item per call.
Streamed, it sends the Responses event sequence (`response.created` ... `response.completed`,
each event with its `sequence_number`), as the OpenAI SDK's stream helper checks it.

Nothing is stored: `store` is accepted and the response says `"store": false`;
`previous_response_id` is a 400 (send the whole conversation in `input`).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import Field, PrivateAttr

from fairbatch.deployments.api import schemas as S
from fairbatch.deployments.api.schemas import ApiError, bad_request
from fairbatch.engine.sampling_params import MAX_DEADLINE_S


class ResponsesRequest(S._Body):
    model: str = Field(min_length=1)
    input: Any  # str | list of items, checked in `messages`
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool | None = False
    tools: list[Any] | None = None
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "name": ...}
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | ...}}
    store: bool | None = None  # accepted; nothing is stored
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None  # returned as sent
    user: str | None = None
    truncation: Literal["disabled"] | None = None  # "auto" (drop old turns) is not supported
    include: list[str] | None = None  # no extra output data is supported: empty only
    reasoning: dict[str, Any] | None = None  # accepted: the model thinks as it was trained to
    # accepted, with nothing to do here: there is no obfuscation to turn off, every prompt is
    # prefix-cached by its tenant's salt, one service tier; `safety_identifier` as `user`
    stream_options: dict[str, bool] | None = None
    prompt_cache_key: str | None = None
    service_tier: Literal["auto", "default"] | None = None
    safety_identifier: str | None = None
    background: Literal[False] | None = None  # a response runs while its request is open
    # fairbatch's extensions, as on the other endpoints
    ignore_eos: bool = False
    timeout: float | None = Field(default=None, gt=0, le=MAX_DEADLINE_S)
    max_queue_time_s: float | None = Field(default=None, gt=0, le=MAX_DEADLINE_S)

    # per chat message: the field it came from, and the input item of each of its tool calls
    _sources: list[tuple[str, list[str]]] = PrivateAttr(default_factory=list)

    def chat_body(self) -> dict[str, Any]:
        """The Chat Completions body this request asks for."""
        if self.previous_response_id is not None:
            raise bad_request(
                "this server stores no responses: send the whole conversation in input",
                "previous_response_id",
            )
        if self.include:
            raise bad_request("include is not supported", "include")
        if self.stream_options is not None and not self.stream:
            raise bad_request(
                "stream_options is only allowed when stream is true", "stream_options"
            )
        body: dict[str, Any] = {"model": self.model, "messages": self.messages()}
        fields = ("temperature", "top_p", "stream", "parallel_tool_calls", "user", "ignore_eos",
                  "timeout", "max_queue_time_s")  # fmt: skip
        for name in fields:
            value = getattr(self, name)
            if value is not None:
                body[name] = value
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.tools is not None:
            body["tools"] = [_chat_tool(t, f"tools.{i}") for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        response_format = self.response_format()
        if response_format is not None:
            body["response_format"] = response_format
        return body

    def messages(self) -> list[dict[str, Any]]:
        """`instructions` and `input` as chat messages; `_sources` says where each came from,
        for `param_of`."""
        out: list[dict[str, Any]] = []
        self._sources = []
        if self.instructions is not None:
            out.append({"role": "system", "content": self.instructions})
            self._sources.append(("instructions", []))
        if isinstance(self.input, str):
            out.append({"role": "user", "content": self.input})
            self._sources.append(("input", []))
            return out
        if not isinstance(self.input, list) or not self.input:
            raise bad_request("input must be a string or a non-empty list of items", "input")
        for i, item in enumerate(self.input):
            param = f"input.{i}"
            if not isinstance(item, dict):
                raise bad_request("an input item must be an object", param)
            kind = item.get("type", "message")
            if kind == "message":
                role = item.get("role")
                if role not in ("user", "system", "developer", "assistant"):
                    raise bad_request(f"unknown role {role!r}", f"{param}.role")
                out.append({"role": role, "content": _text(item.get("content"), param)})
                self._sources.append((param, []))
            elif kind == "function_call":
                call = {"id": _str(item, "call_id", param), "type": "function",
                        "function": {"name": _str(item, "name", param),
                                     "arguments": _str(item, "arguments", param)}}  # fmt: skip
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)  # calls made together
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
                    self._sources.append((param, []))
                self._sources[-1][1].append(param)
            elif kind == "function_call_output":
                output = item.get("output")
                if isinstance(output, list):
                    output = _text(output, param)
                if not isinstance(output, str):
                    raise bad_request("output must be a string", f"{param}.output")
                tool_call_id = _str(item, "call_id", param)
                out.append({"role": "tool", "tool_call_id": tool_call_id, "content": output})
                self._sources.append((param, []))
            elif kind == "reasoning":
                continue  # earlier thinking: reasoning models are prompted without it
            else:
                raise bad_request(f"input items of type {kind!r} are not supported", param)
        return out

    def param_of(self, param: str | None) -> str | None:
        """The field of this request that the chat request's `param` was made from."""
        if param is None:
            return None
        head, _, rest = param.partition(".")
        if head == "messages" and rest:
            index, _, rest = rest.partition(".")
            if not index.isdigit() or int(index) >= len(self._sources):
                return "input"
            field, calls = self._sources[int(index)]
            if rest.startswith("tool_calls."):  # tool_calls.K.function.arguments
                k, _, tail = rest[len("tool_calls.") :].partition(".")
                if k.isdigit() and int(k) < len(calls):
                    return ".".join(filter(None, (calls[int(k)], tail.rpartition(".")[2])))
            if field.startswith("input.") and rest.split(".")[0] in ("content", "role"):
                return f"{field}.{rest.split('.')[0]}"
            return field
        if head in ("max_tokens", "max_completion_tokens"):
            return "max_output_tokens"
        if head in ("prompt", "messages"):
            return "input"
        if head == "response_format":
            return "text.format"
        if head == "tools":  # tools.I.function.X: the Responses tool is flat
            return param.replace(".function", "", 1)
        return param

    def response_format(self) -> dict[str, Any] | None:
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return None
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "json_object"}
        if kind == "json_schema":
            spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
            return {"type": "json_schema", "json_schema": spec}
        raise bad_request(
            "text.format.type must be text, json_object or json_schema", "text.format"
        )


def _str(item: dict, key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{key} must be a string", f"{param}.{key}")
    return value


def _text(content: Any, param: str) -> str:
    """A message's content: a string, or text parts (input_text, output_text) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("content must be a string or a list of text parts", f"{param}.content")
    parts = []
    for part in content:
        if not (isinstance(part, dict) and part.get("type") in ("input_text", "output_text")):
            raise bad_request("only text content parts are supported", f"{param}.content")
        if not isinstance(part.get("text"), str):
            raise bad_request("a text content part needs a string 'text'", f"{param}.content")
        parts.append(part["text"])
    return "".join(parts)


def _chat_tool(tool: Any, param: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise bad_request("only function tools are supported", param)
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice  # "none" | "auto" | "required", or what the chat path refuses by name


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class ResponseBuilder:
    """One chat run's reply as a Responses `response` object, whole or as its event stream."""

    def __init__(self, request: ResponsesRequest, run: Any) -> None:
        self.request = request
        self.run = run
        self.id = run.ticket.request_id  # "resp_...": GET/DELETE /v1/requests/{id} find it
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # the items done so far
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.open_text: list[str] = []  # its text so far (a message or reasoning item)
        # the tools as the Responses API writes them (flat), once checked
        self.tools = [_chat_tool(t, "tools")["function"] | {"type": "function"}
                      for t in request.tools or []]  # fmt: skip
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> its item

    # -- the response object ----------------------------------------------------------------

    def response(self, status: str, finish: str | None = None, error: Any = None) -> dict:
        r, tools = self.request, self.tools
        prompt, completion, cached, reasoning = self.run.usage()
        body: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.run.created,
            "status": status,
            "model": self.run.model,
            "output": list(self.output),
            "error": error,
            "incomplete_details": _incomplete(finish),
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "metadata": r.metadata or {},
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "service_tier": "default",
            "store": False,
            "temperature": 1.0 if r.temperature is None else r.temperature,
            "text": r.text or {"format": {"type": "text"}},
            "tool_choice": r.tool_choice or ("auto" if tools else "none"),
            "tools": tools,
            "top_p": 1.0 if r.top_p is None else r.top_p,
            "truncation": "disabled",
            "usage": None,
            "user": r.user,
        }
        if status != "in_progress":
            body["usage"] = {
                "input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": completion,
                "output_tokens_details": {"reasoning_tokens": reasoning or 0},
                "total_tokens": prompt + completion,
            }
        return body

    def whole(self, choice: dict) -> dict:
        """The response of a whole chat choice (its message and finish_reason)."""
        message, finish = choice["message"], choice["finish_reason"]
        if message.get("reasoning_content"):
            self.output.append(self._reasoning(message["reasoning_content"], "completed"))
        if message.get("content") or not message.get("tool_calls"):
            self.output.append(self._message(message.get("content") or "", "completed"))
        for call in message.get("tool_calls") or []:
            f = call["function"]
            self.output.append(self._call(call["id"], f["name"], f["arguments"], "completed"))
        status = _status(finish)
        if status == "incomplete":  # the item it was writing when cut short
            self.output[-1]["status"] = status
        return self.response(status, finish)

    @staticmethod
    def _message(text: str, status: str) -> dict:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return {"type": "message", "id": _item_id("msg"), "status": status, "role": "assistant",
                "content": [] if status == "in_progress" else [part]}  # fmt: skip

    @staticmethod
    def _reasoning(text: str, status: str) -> dict:
        content = [] if status == "in_progress" else [{"type": "reasoning_text", "text": text}]
        return {"type": "reasoning", "id": _item_id("rs"), "summary": [], "content": content,
                "status": status}  # fmt: skip

    @staticmethod
    def _call(call_id: str, name: str, arguments: str, status: str) -> dict:
        return {"type": "function_call", "id": _item_id("fc"), "call_id": call_id, "name": name,
                "arguments": arguments, "status": status}  # fmt: skip

    # -- the event stream ---------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    async def events(self) -> AsyncIterator[str]:
        """The response's events, from the run's streamed chat choices."""
        yield self._event("response.created", response=self.response("in_progress"))
        yield self._event("response.in_progress", response=self.response("in_progress"))
        finish = None
        choices = self.run.choices()
        try:
            async for choice in choices:
                if isinstance(choice, ApiError):
                    for e in self._close():
                        yield e
                    err = choice.body()["error"]
                    error = {"code": err.get("code") or err.get("type"), "message": err["message"]}
                    yield self._event(
                        "response.failed", response=self.response("failed", error=error)
                    )
                    return
                delta = choice["delta"]
                if delta.get("reasoning_content"):
                    for e in self._text("reasoning", delta["reasoning_content"]):
                        yield e
                if delta.get("content"):
                    for e in self._text("message", delta["content"]):
                        yield e
                for call in delta.get("tool_calls") or []:
                    for e in self._tool_call(call):
                        yield e
                if choice["finish_reason"] is not None:
                    finish = choice["finish_reason"]
        finally:  # (a client that left: the run's stream closes now, not when collected)
            await choices.aclose()
        status = _status(finish)
        for e in self._close(status):  # the item it was writing when cut short
            yield e
        kind = "response.completed" if status == "completed" else "response.incomplete"
        yield self._event(kind, response=self.response(status, finish))

    def _index(self) -> int:
        return len(self.output)

    def _text(self, kind: str, text: str) -> list[str]:
        """Text of a message or reasoning item: a new item unless that kind is open."""
        out = []
        if self.open is None or self.open["type"] != kind:
            out += self._close()
            self.open = (self._message if kind == "message" else self._reasoning)("", "in_progress")
            self.open_text = []
            out.append(self._added())
            if kind == "message":
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                out.append(self._event("response.content_part.added", **self._ids(), part=part))
        self.open_text.append(text)
        if kind == "message":
            out.append(self._event("response.output_text.delta", **self._ids(), delta=text,
                                   logprobs=[]))  # fmt: skip
        else:
            out.append(self._event("response.reasoning_text.delta", **self._ids(), delta=text))
        return out

    def _ids(self) -> dict[str, Any]:
        """Where a text event of the open item goes."""
        return {"item_id": self.open["id"], "output_index": self._index(), "content_index": 0}

    def _tool_call(self, call: dict) -> list[str]:
        """A chat tool-call delta: a new call (id, name), or more of its arguments."""
        out = []
        index, f = call.get("index", 0), call.get("function") or {}
        item = self.calls.get(index)
        if item is None:
            out += self._close()
            item = self.open = self._call(call["id"], f.get("name", ""), "", "in_progress")
            self.calls[index] = item
            out.append(self._added())
        if f.get("arguments"):
            item["arguments"] += f["arguments"]
            out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                   output_index=self._index(), delta=f["arguments"]))  # fmt: skip
        return out

    def _added(self) -> str:
        return self._event("response.output_item.added", output_index=self._index(), item=self.open)

    def _close(self, status: str = "completed") -> list[str]:
        """The done events of the open item, which joins the output with `status`."""
        item, self.open = self.open, None
        if item is None:
            return []
        out, index = [], self._index()
        kind, ids = item["type"], {"item_id": item["id"], "output_index": index}
        text = "".join(self.open_text)
        if kind == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out.append(self._event("response.output_text.done", **ids, content_index=0, text=text,
                                   logprobs=[]))  # fmt: skip
            out.append(self._event("response.content_part.done", **ids, content_index=0, part=part))
            item["content"] = [part]
        elif kind == "reasoning":
            out.append(self._event("response.reasoning_text.done", **ids, content_index=0,
                                   text=text))  # fmt: skip
            item["content"] = [{"type": "reasoning_text", "text": text}]
        else:
            out.append(self._event("response.function_call_arguments.done", **ids,
                                   arguments=item["arguments"]))  # fmt: skip
        item["status"] = status
        self.output.append(item)
        out.append(self._event("response.output_item.done", output_index=index, item=item))
        return out


# chat finish_reason -> why a response is incomplete ("timeout": fairbatch's deadlines)
INCOMPLETE = {"length": "max_output_tokens", "timeout": "timeout"}


def _incomplete(finish: str | None) -> dict | None:
    reason = INCOMPLETE.get(finish or "")
    return None if reason is None else {"reason": reason}


def _status(finish: str | None) -> str:
    return "incomplete" if finish in INCOMPLETE else "completed"
