"""OpenAI request bodies (validated) and response bodies (built), for the ingress.

Requests are pydantic models in strict mode: `"temperature": "0.5"` or `"max_tokens": true` is a
400, not a silent coercion; non-finite floats are refused; an unknown field is a 400 naming it
(never silently ignored). Fields that take several shapes (`prompt`, `stop`, message
`content`) are checked by hand so their errors read plainly.

Extensions beyond OpenAI, as vLLM names them: `top_k`, `min_p`, `repetition_penalty`,
`ignore_eos`, chat's `chat_template_kwargs`; and deadlines, in seconds from arrival: `timeout`
(the request ends with finish reason "timeout", with what it produced) and `max_queue_time_s`
(until it is first scheduled).
"""

from __future__ import annotations

import json
import math
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fairbatch.engine.sampling_params import MAX_DEADLINE_S, MAX_LOGPROBS, MAX_N, SamplingParams

INT64_MIN, UINT64_END = -(2**63), 2**64


class ApiError(Exception):
    """An error for the client, in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


# ---- requests ---------------------------------------------------------------------------------


class _Body(BaseModel):
    # A field this server does not know is a 400 naming it: never silently ignored.
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    """Fields shared by both endpoints."""

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)  # -1 or 0 = off
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=10)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    seed: int | None = Field(default=None, ge=INT64_MIN, lt=UINT64_END)
    stop: Any = None  # str | list[str] | None, checked in `stop_list`
    n: int | None = Field(default=None, ge=1, le=MAX_N)  # samples per prompt (shared KV)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None  # OpenAI's end-user id for abuse tracking: accepted, never logged
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    # deadlines in seconds from arrival (None: the tenant's default, see TenantConfig)
    timeout: float | None = Field(default=None, gt=0, le=MAX_DEADLINE_S)
    max_queue_time_s: float | None = Field(default=None, gt=0, le=MAX_DEADLINE_S)

    def logit_bias_ids(self, vocab: int) -> dict[int, float] | None:
        """The bias as {token id: value}, values clamped to [-100, 100] (as OpenAI does)."""
        if not self.logit_bias:
            return None
        out: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            if not (key.isascii() and key.isdigit()):  # (int() also takes " 5 ", "+5", "5_0")
                raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
            token = int(key)
            if token >= vocab:
                raise bad_request(
                    f"logit_bias token id {token} is outside the vocabulary [0, {vocab})",
                    "logit_bias",
                )
            out[token] = min(100.0, max(-100.0, float(value)))
        return out

    def stop_list(self, max_stops: int) -> list[str]:
        stop = self.stop
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad_request("stop must be a string or a list of strings", "stop")
        if len(stop) > max_stops:
            raise bad_request(f"stop takes at most {max_stops} sequences", "stop")
        if any(not s for s in stop):
            raise bad_request("stop sequences must not be empty", "stop")
        return stop

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request(
                "stream_options is only allowed when stream is true", "stream_options"
            )

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        stop: list[str],
        *,
        vocab: int,
        prompt_logprobs: int | None = None,
        deadlines: tuple[float | None, float | None] = (None, None),
    ):
        """`deadlines`: the tenant's (timeout, max_queue_time_s), for fields left unset."""
        temperature = 1.0 if self.temperature is None else self.temperature
        bias = self.logit_bias_ids(vocab)
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k or 0,
                min_p=self.min_p or 0.0,
                seed=self.seed,
                stop=stop,
                ignore_eos=self.ignore_eos,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=1.0
                if self.repetition_penalty is None
                else self.repetition_penalty,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                logit_bias=bias,
                n=self.n or 1,
                timeout=deadlines[0] if self.timeout is None else self.timeout,
                max_queue_time_s=deadlines[1]
                if self.max_queue_time_s is None
                else self.max_queue_time_s,
            )
        except ValueError as e:  # every range is checked above; this is a last line
            raise bad_request(str(e)) from None


class CompletionRequest(_SamplingFields):
    prompt: Any = Field(default=...)  # str | list[int] | [str] | [list[int]], see `prompts`
    # 0 only with echo: score the prompt, generate nothing
    max_tokens: int | None = Field(default=None, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    response_format: dict[str, Any] | None = None  # deployments/api/structured.py

    def check_unsupported(self) -> None:
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != 1:
            raise bad_request("best_of must be 1", "best_of")
        if self.max_tokens == 0 and not self.echo:
            raise bad_request("max_tokens 0 is only allowed with echo", "max_tokens")

    def prompts(self, limit: int) -> list[str | list[int]]:
        """The prompts, each text or token ids: a string, a list of token ids, or a list of
        either (a batch: one choice per prompt, in order)."""
        p = self.prompt
        if isinstance(p, str) or (isinstance(p, list) and p and all(_is_id(t) for t in p)):
            batch = [p]
        elif isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
            batch = p
        elif isinstance(p, list) and not p:
            raise bad_request("prompt must not be empty", "prompt")
        else:
            raise bad_request(
                "prompt must be a string, a list of token ids, or a list of either", "prompt"
            )
        if len(batch) > limit:
            raise bad_request(
                f"at most {limit} prompts per request (limits.max_prompts_per_request), "
                f"got {len(batch)}",
                "prompt",
                "too_many_prompts",
            )
        for i, x in enumerate(batch):
            if not x:
                raise bad_request(f"prompt {i} is empty", "prompt")
            if isinstance(x, list) and not all(_is_id(t) for t in x):
                raise bad_request(f"prompt {i} must be a string or a list of token ids", "prompt")
        return batch


def _is_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


class ToolCallFunction(_Body):
    name: str
    arguments: str  # JSON text, as the API returned it


class ToolCallIn(_Body):
    """A call an assistant message made earlier in the conversation (sent back by the client)."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction

    def for_template(self, param: str) -> dict[str, Any]:
        """As chat templates take it: the arguments as an object, not JSON text (Hugging Face's
        tool-use convention; vLLM converts them the same way before rendering)."""
        where = f"{param}.function.arguments"
        try:
            arguments = json.loads(self.function.arguments)
        except ValueError:
            raise bad_request("the arguments must be JSON text", where) from None
        if not isinstance(arguments, dict):
            raise bad_request("the arguments must be a JSON object", where)
        function = {"name": self.function.name, "arguments": arguments}
        return {"id": self.id, "type": "function", "function": function}


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None  # str | [{"type": "text", "text": str}] | None, checked in `text`
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's calls, in a conversation's history
    tool_call_id: str | None = None  # the call whose result a tool message carries
    # an assistant's thinking in a conversation's history (a reasoning_parser reply passed back
    # as it is): accepted on assistant messages and not shown to the template, as reasoning
    # models are prompted with their earlier answers only
    reasoning_content: str | None = None

    def text(self, index: int) -> str:
        content, param = self.content, f"messages.{index}.content"
        if isinstance(content, list):
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"):
                    raise bad_request("only text content parts are supported", param)
                if not isinstance(part.get("text"), str):
                    raise bad_request("a text content part needs a string 'text'", param)
                parts.append(part["text"])
            content = "".join(parts)
        elif content is not None and not isinstance(content, str):
            raise bad_request("content must be a string or a list of text parts", param)
        if content is None:
            if self.role != "assistant":
                raise bad_request(
                    f"messages[{index}] ({self.role}) needs content", f"messages.{index}.content"
                )
            content = ""
        return content


# What the chat template render passes itself (and its helpers): `chat_template_kwargs` may not
# name them. The others go to the template as they are, as Hugging Face's apply_chat_template
# passes its extra kwargs (a name the template does not use changes nothing).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
        "bos_token", "eos_token", "raise_exception", "strftime_now", "chat_template", "tokenize",
    }
)  # fmt: skip


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """`chat_template_kwargs` checked: a JSON object whose names are not the render's own."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise bad_request("chat_template_kwargs must be a JSON object", "chat_template_kwargs")
    taken = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if taken:
        raise bad_request(
            f"chat_template_kwargs cannot set {', '.join(taken)}: the server renders "
            "the template with its own",
            "chat_template_kwargs",
        )
    return dict(kwargs)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # checked in deployments/api/structured.py
    tools: list[Any] | None = None
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", ...}
    parallel_tool_calls: bool | None = None  # false: "auto" returns one call (forced: one)
    response_format: dict[str, Any] | None = None
    # passed to the chat template's render, as vLLM does (e.g. {"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = None
    # Accepted with nothing to do, as on /v1/responses: nothing is stored, prompts are
    # prefix-cached by their tenant's salt, there is one service tier.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    service_tier: Literal["auto", "default"] | None = None
    safety_identifier: str | None = None

    def check_unsupported(self) -> None:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")

    def chat_messages(self) -> list[dict[str, Any]]:
        """The messages as chat templates take them. "developer" is OpenAI's newer name for
        "system" (templates know only "system"); an assistant's earlier tool calls and a tool
        message's `tool_call_id` are kept, so a template that renders tool use shows them."""
        out: list[dict[str, Any]] = []
        for i, m in enumerate(self.messages):
            msg: dict[str, Any] = {
                "role": "system" if m.role == "developer" else m.role,
                "content": m.text(i),
            }
            if m.tool_calls is not None:
                if m.role != "assistant":
                    raise bad_request("only assistant messages carry tool_calls", f"messages.{i}")
                param = f"messages.{i}.tool_calls"
                calls = [c.for_template(f"{param}.{j}") for j, c in enumerate(m.tool_calls)]
                msg["tool_calls"] = calls
            if m.reasoning_content is not None and m.role != "assistant":
                raise bad_request(
                    "only assistant messages carry reasoning_content", f"messages.{i}"
                )
            if m.tool_call_id is not None:
                if m.role != "tool":
                    raise bad_request("only tool messages carry tool_call_id", f"messages.{i}")
                msg["tool_call_id"] = m.tool_call_id
            elif m.role == "tool":  # (as OpenAI: the result of which call)
                raise bad_request(
                    "a tool message needs the tool_call_id it answers", f"messages.{i}.tool_call_id"
                )
            out.append(msg)
        return out


class TenantPatch(BaseModel):
    """PATCH /admin/tenants/{name}: fields left out are unchanged; tokens_per_minute null
    removes the quota, max_requests null returns to `limits.max_requests_per_tenant`; weight and
    priority cannot be null."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")
    weight: float | None = Field(default=None, gt=0, le=1e6)
    priority: int | None = Field(default=None, ge=-1000, le=1000)
    tokens_per_minute: float | None = Field(default=None, gt=0)
    max_requests: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _no_null_share(self) -> TenantPatch:
        for name in ("weight", "priority"):
            if name in self.model_fields_set and getattr(self, name) is None:
                raise ValueError(f"{name} cannot be null: leave it out to keep it unchanged")
        return self


# ---- responses --------------------------------------------------------------------------------


def usage(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int = 0,
    reasoning_tokens: int | None = None,
) -> dict:
    """OpenAI's usage object; `cached_tokens`: prompt tokens served from the prefix cache;
    `reasoning_tokens`: the completion's thinking, where a reasoning parser split it off."""
    body = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return body


def finish_reason(reason: str | None) -> str | None:
    """Engine reasons -> OpenAI's: "stop" (EOS, stop token or string) or "length"; and
    "timeout" (an extension: the request's deadline passed)."""
    if reason is None:
        return None
    return reason if reason in ("length", "timeout") else "stop"


class LoRALoad(BaseModel):
    """POST /admin/loras: a PEFT adapter directory to serve as model `name`."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.\-]+$")
    path: str = Field(min_length=1)
    tenants: list[str] | None = None  # who may use it; None: every tenant


def model_card(name: str, created: int, max_model_len: int) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "fairbatch",
        "max_model_len": max_model_len,
    }


def _finite(logprob: float) -> float:
    # JSON has no -Infinity; OpenAI reports impossible tokens as -9999.0.
    return logprob if math.isfinite(logprob) else -9999.0


class LogprobFormatter:
    """The sampler's [(sampled, lp), (top1, lp), ...] records, in OpenAI's two shapes."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def token(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"<{token_id}>"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def chat(self, records: list[Any], top_n: int) -> list[dict]:
        out = []
        for rec in records:
            (tid, lp), tops = rec[0], rec[1 : 1 + top_n]
            tok = self.token(tid)
            out.append(
                {
                    "token": tok,
                    "logprob": _finite(lp),
                    "bytes": list(tok.encode("utf-8")),
                    "top_logprobs": [
                        {"token": t, "logprob": _finite(v), "bytes": list(t.encode("utf-8"))}
                        for t, v in ((self.token(i), v) for i, v in tops)
                    ],
                }
            )
        return out

    def completion(self, records: list[Any], top_n: int, offset: int) -> dict:
        """Records may hold a None log-prob (an echoed prompt's first token, which has no
        context): its `token_logprobs` and `top_logprobs` entries are null, as OpenAI's.
        `text_offset` indexes the choice's text: a special token the text leaves out (an echoed
        prompt's BOS) is listed at the offset of what follows it and takes no room."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for rec in records:
            (tid, lp), top = rec[0], rec[1 : 1 + top_n]
            tok = self.token(tid)
            tokens.append(tok)
            token_lps.append(None if lp is None else _finite(lp))
            scored = top_n and lp is not None
            tops.append({self.token(i): _finite(v) for i, v in top} if scored else None)
            offsets.append(offset)
            if self.tokenizer is None:
                offset += len(tok)
            else:  # the token's text as the choice's text has it
                offset += len(self.tokenizer.decode([tid], skip_special_tokens=True))
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }


def now() -> int:
    return int(time.time())
