"""The handle API: other Ray apps call fairbatch without HTTP.

    from ray import serve

    fb = serve.get_app_handle("fairbatch")
    out = await fb.complete.remote({"prompt": "Hello", "tenant": "team-a", "max_tokens": 16})
    # {"id", "text", "token_ids", "finish_reason", "usage": {...}, "num_cached_tokens"}

    stream = fb.options(stream=True).generate.remote(
        {"messages": [{"role": "user", "content": "Hi"}], "tenant": "team-a", "max_tokens": 32}
    )
    async for chunk in stream:  # {"id", "text", "token_ids", "finished", "finish_reason"}
        ...

The first chunk also carries "num_cached_tokens" (prompt tokens found in the prefix cache)
and, when the call set `prompt_logprobs: k`, "prompt_logprobs" (None for the first prompt
token, then one record [(token, logprob), (top1, logprob), ...] per prompt token); `complete`
returns both.

A call is admitted exactly as an HTTP request is (the tenant's quota and in-flight bounds,
the model's context length); a refusal raises `HandleRejected` (status 429/503 and
`retry_after`), a bad request `ValueError`; a request the backend failed to serve (no replica
or fairness controller could take it in time) raises `HandleRejected` with status 503, before
or after its first chunk. Handle callers are code inside the cluster, so
they name the tenant (no key) and may set `priority`; the tenant must exist in the config
(or be the anonymous default tenant when that is allowed). Breaking out of the stream (or
cancelling the call) aborts the request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fairbatch.deployments.api.coalesce import coalesce
from fairbatch.deployments.api.config import format_validation_error
from fairbatch.deployments.api.responses import ResponseRun
from fairbatch.deployments.api.schemas import ApiError, template_kwargs
from fairbatch.deployments.cluster.wire import FIRST_ONLY
from fairbatch.engine.sampling_params import MAX_DEADLINE_S, SamplingParams

log = logging.getLogger("fairbatch.api")


class HandleRejected(Exception):
    """Admission refused: over quota or a bound (`status` 429), or the server is full (503)."""

    def __init__(self, status: int, code: str, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.retry_after = retry_after

    def __reduce__(self):  # crosses process boundaries inside RayTaskError
        return (HandleRejected, (self.status, self.code, str(self), self.retry_after))


class GenerateRequest(BaseModel):
    """One handle call. Exactly one of `prompt`, `prompt_token_ids`, `messages`."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None  # rendered with the model's chat template
    # with `messages`: passed to the template's render (e.g. {"enable_thinking": False}), as the
    # HTTP API's chat field of the same name
    chat_template_kwargs: dict[str, Any] | None = None
    tenant: str | None = None  # None = the anonymous default tenant
    model: str | None = None  # a LoRA adapter's name, or the base model's id; None = the base
    priority: int | None = Field(default=None, ge=-1000, le=1000)  # None = the tenant's
    request_id: str | None = Field(default=None, min_length=1, max_length=128)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    prompt_logprobs: int | None = None  # a log-prob record per prompt token, with the top-k
    stop: list[str] | str | None = None
    ignore_eos: bool = False
    # deadlines in seconds from the call (None: the tenant's default); past one the request
    # ends with finish_reason "timeout" and the tokens it produced
    timeout: float | None = Field(default=None, gt=0, le=MAX_DEADLINE_S)
    max_queue_time_s: float | None = Field(default=None, gt=0, le=MAX_DEADLINE_S)

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        given = [x is not None for x in (self.prompt, self.prompt_token_ids, self.messages)]
        if sum(given) != 1:
            raise ValueError("give exactly one of prompt, prompt_token_ids, messages")
        if self.chat_template_kwargs is not None:
            if self.messages is None:
                raise ValueError("chat_template_kwargs go with messages")
            try:
                template_kwargs(self.chat_template_kwargs)
            except ApiError as e:
                raise ValueError(e.message) from None
        return self


def parse_request(
    request: dict[str, Any] | GenerateRequest | None, kwargs: dict
) -> GenerateRequest:
    if isinstance(request, GenerateRequest) and not kwargs:
        return request
    if request is not None and not isinstance(request, (dict, GenerateRequest)):
        raise ValueError(
            f"a generate request is a dict (or keyword arguments), got {type(request).__name__}"
        )
    data = dict(request or {}) if not isinstance(request, GenerateRequest) else request.model_dump()
    data.update(kwargs)
    try:
        return GenerateRequest.model_validate(data)
    except ValidationError as e:
        raise ValueError(
            "invalid generate request: " + format_validation_error(e).replace("\n", "; ")
        ) from None


class HandleApi:
    """Mixed into the Serve ingress; needs `self.api_app` (the API's FastAPI app)."""

    api_app: Any

    async def complete(self, request: dict[str, Any] | None = None, **kwargs: Any) -> dict:
        """Run one request to the end: {"id", "text", "token_ids", "finish_reason", "usage"},
        plus the first chunk's "num_cached_tokens" and "prompt_logprobs" (when present)."""
        text: list[str] = []
        ids: list[int] = []
        last: dict = {}
        once: dict = {}
        async for chunk in self.generate(request, **kwargs):
            text.append(chunk["text"])
            ids.extend(chunk["token_ids"])
            once.update((key, chunk[key]) for key in FIRST_ONLY if key in chunk)
            last = chunk
        return {
            **once,
            "id": last.get("id"),
            "text": "".join(text),
            "token_ids": ids,
            "finish_reason": last.get("finish_reason"),
            "usage": last.get("usage"),
        }

    async def generate(
        self, request: dict[str, Any] | None = None, **kwargs: Any
    ) -> AsyncIterator[dict]:
        """Stream chunks {"id", "text", "token_ids", "finished", "finish_reason"}; the last one
        (finished) also carries "usage". Call with `handle.options(stream=True)`."""
        api = self.api_app.state.api
        req = parse_request(request, kwargs)
        try:
            api.ready()
            tenant = api.registry.tenants.get(req.tenant or api.registry.anonymous)
            if req.tenant is None and not api.registry.allow_anonymous:
                raise ValueError("name the request's tenant: this app has no anonymous tenant")
            if tenant is None:
                raise ValueError(f"unknown tenant {req.tenant!r}")
            lora = None if req.model is None else api.check_model(req.model, tenant)
            ids = await self._prompt_ids(api, req)
            max_tokens = api.max_tokens(len(ids), req.max_tokens, api.limits.default_max_tokens)
        except ApiError as e:
            raise _handle_error(e) from None
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            seed=req.seed,
            prompt_logprobs=req.prompt_logprobs,
            stop=req.stop,
            ignore_eos=req.ignore_eos,
            timeout=tenant.deadlines[0] if req.timeout is None else req.timeout,
            max_queue_time_s=tenant.deadlines[1]
            if req.max_queue_time_s is None
            else req.max_queue_time_s,
            lora=lora,
        )
        model = req.model or api.model_name
        try:  # admitted and started as an HTTP request is (quota, bounds, salt, usage)
            [(ticket, it, first, _, _)] = await api.launch(
                None, tenant, "handle-", [(ids, params)],
                model=model, request_id=req.request_id, priority=req.priority,
            )  # fmt: skip
        except ApiError as e:
            raise _handle_error(e) from None
        run = ResponseRun(api, ticket, it, first, chat=False, top_n=None, model=model)
        merged = coalesce(run.deltas(), api.config.stream_interval_ms / 1000.0)
        try:
            async for d in merged:
                run.account(d)
                chunk = {
                    "id": ticket.request_id,
                    "text": d.text,
                    "token_ids": list(d.token_ids),
                    "finished": d.finished,
                    "finish_reason": d.finish_reason,
                }
                for key in FIRST_ONLY:  # the first delta's
                    value = getattr(d, key, None)
                    if value is not None:
                        chunk[key] = value
                if d.finished:
                    run.outcome = "ok"
                    if d.finish_reason == "error":  # retryable, as the API's 503
                        raise _handle_error(api.backend_error(ticket))
                    p, c = ticket.prompt_tokens, ticket.completion_tokens
                    chunk["usage"] = {"prompt_tokens": p, "completion_tokens": c,
                                      "total_tokens": p + c}  # fmt: skip
                yield chunk
                if d.finished:
                    break
        finally:
            await asyncio.shield(merged.aclose())
            await run.close()

    async def load_lora(self, name: str, path: str, tenants: list[str] | None = None) -> dict:
        """Serve the PEFT adapter at `path` as model `name`, to `tenants` (None: every tenant),
        once every replica has read and validated it; a ValueError saying why not."""
        api = self.api_app.state.api
        try:
            api.ready()
            return await api.load_lora(name, path, tenants)
        except ApiError as e:
            raise ValueError(e.message) from None

    async def unload_lora(self, name: str) -> dict:
        """Stop serving adapter `name`: calls naming it fail from now on; those already
        accepted run to their end."""
        try:
            return await self.api_app.state.api.unload_lora(name)
        except ApiError as e:
            raise ValueError(e.message) from None

    @staticmethod
    async def _prompt_ids(api: Any, req: GenerateRequest) -> list[int]:
        if req.prompt_token_ids is not None:
            return api.check_ids(list(req.prompt_token_ids))
        if req.messages is not None:
            text = api.tokenizer.apply_chat_template(
                req.messages, **(req.chat_template_kwargs or {})
            )
            bos = api.tokenizer.bos_token
            return await api.encode(text, add_special_tokens=not (bos and text.startswith(bos)))
        return await api.encode(req.prompt)


def _handle_error(e: ApiError) -> Exception:
    """An API error as a handle caller gets it: a refusal or an unavailable backend (429,
    5xx) as `HandleRejected` with its `retry_after`, anything else as a ValueError (the
    keyword-only ApiError would not unpickle at the caller)."""
    if e.status == 429 or e.status >= 500:
        retry = int(e.headers.get("Retry-After", "1"))
        return HandleRejected(e.status, e.code or "unavailable", e.message, retry)
    return ValueError(e.message)
