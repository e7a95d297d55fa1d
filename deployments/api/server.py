"""`create_app(backend, config) -> FastAPI`: the OpenAI-compatible HTTP API over a backend.

Routes: GET /health, GET /v1/models[/{model}], POST /v1/completions, POST /v1/chat/completions,
POST /v1/responses (OpenAI's Responses API, served through the chat path), GET|DELETE
/v1/requests/{id} (the caller's own in-flight requests only), and the admin routes
GET /admin/tenants, PATCH /admin/tenants/{name}.

Every request goes: key -> tenant (401), body read under a size cap (413, before parsing),
JSON + schema (400), model (404), tokenize + context check (400), quota and in-flight bounds
(429/503 with Retry-After), then the backend. Every error has OpenAI's shape
{"error": {"message", "type", "param", "code"}}; user input never yields a 500.

A client that goes away is noticed while its request waits for its first token (the request
is cancelled) and while it streams (the stream is closed): either way the backend iterator is
closed, which aborts the request and frees its KV blocks. Logs carry request ids, tenants and
token counts, never keys or prompt text.

The routes are in routes.py (health, models, the caller's own requests, admin) and
generation.py (completions, chat, responses); `_Api` here is the state they share, at
`request.app.state.api`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fairbatch.deployments.api import generation, routes
from fairbatch.deployments.api import schemas as S
from fairbatch.deployments.api.config import AppConfig, parse_config
from fairbatch.deployments.api.http import (
    ClientGone,
    close_stream,
    error_response,
    maybe_await,
    until_disconnect,
    validation_message,
)
from fairbatch.deployments.api.loras import LoRARegistry
from fairbatch.deployments.api.prometheus import ApiMetrics, add_metrics_route
from fairbatch.deployments.api.schemas import ApiError, bad_request
from fairbatch.deployments.api.tenants import (
    Admission,
    AuthError,
    Rejected,
    TenantRegistry,
    TenantState,
)
from fairbatch.deployments.usage import UsageLog, UsageRecord
from fairbatch.engine.sampling_params import LoRARequest

log = logging.getLogger("fairbatch.api")
TOKENIZE_IN_THREAD_CHARS = 4096  # longer texts are tokenized off the event loop


def _unauthorized(message: str) -> ApiError:
    return ApiError(
        401, message, type="authentication_error", code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )  # fmt: skip


class _Api:
    """The state behind the routes: backend, config, tenants."""

    def __init__(
        self, backend: Any, config: AppConfig, clock: Callable[[], float], shared_limits: bool
    ) -> None:
        self.config = config
        self.limits = config.limits
        self.registry = TenantRegistry(config, clock, enforce=not shared_limits)
        self.metrics = ApiMetrics()
        if config.anonymous_risk is not None:
            log.warning("%s", config.anonymous_risk)
        self.model_name = config.model_name
        self.loras = LoRARegistry(self.model_name)
        for a in config.lora_adapters:  # checked against the engine when a backend is bound
            self.loras.add(self.loras.entry(a.name, a.path, a.tenants))
        self.created = int(time.time())
        self.usage_log: UsageLog | None = None
        self.backend: Any = None
        if backend is not None:
            self.bind(backend)

    def bind(self, backend: Any) -> None:
        """Serve through `backend` from now on (its tokenizer and context length too)."""
        self.tokenizer = backend.tokenizer
        self.max_model_len = int(backend.max_model_len)
        if self.limits.max_model_len is not None:
            self.max_model_len = min(self.max_model_len, self.limits.max_model_len)
        self.logprobs = S.LogprobFormatter(self.tokenizer)
        self.backend = backend
        self.usage = None  # where usage records go: the backend's log (a cluster's) or ours
        if self.config.usage is not None:
            self.usage = getattr(backend, "record_usage", None)
            if self.usage is None:
                if self.usage_log is None:
                    self.usage_log = UsageLog(self.config.usage.spec())
                self.usage = self.usage_log.append

    def ready(self) -> None:
        if self.backend is None:
            raise self.unavailable("the model backend is not ready yet; retry later")

    def unavailable(self, message: str) -> ApiError:
        return ApiError(
            503, message, type="server_error", code="backend_unavailable",
            headers={"Retry-After": str(self.limits.retry_after_s)},
        )  # fmt: skip

    # -- tenants -------------------------------------------------------------------------------

    def tenant(self, request: Request) -> TenantState:
        try:
            return self.registry.authenticate(request.headers.get("authorization"))
        except AuthError as e:
            raise _unauthorized(str(e)) from None

    def require_admin(self, request: Request) -> None:
        if not self.registry.admin_enabled:
            raise ApiError(
                403, "the admin API is disabled: no admin key is configured", code="admin_disabled"
            )
        if not self.registry.is_admin(request.headers.get("authorization")):
            raise _unauthorized("the admin API needs the admin key")

    async def push_tenants(self) -> None:
        for t in self.registry.tenants.values():
            await self.push_tenant(t)

    async def push_tenant(self, t: TenantState, change: bool = False) -> None:
        """The tenant's settings to the backend: the config's, or an admin's `change`."""
        hook = getattr(self.backend, "update_tenant", None)
        if hook is not None:
            await maybe_await(
                hook(t.name, t.weight, t.priority, t.tokens_per_minute, t.max_requests, change)
            )

    # -- prompts -------------------------------------------------------------------------------

    def check_model(self, model: str, tenant: TenantState) -> LoRARequest | None:
        """What `model` runs for `tenant`: the base model (None) or a LoRA adapter; 404 for
        an unknown model, 403 for an adapter the tenant may not use."""
        return self.loras.resolve(model, tenant.name)

    async def check_lora(self, lora: LoRARequest) -> None:
        """Have the backend read and validate an adapter: a 400 saying why it cannot serve it."""
        check = getattr(self.backend, "check_lora", None)
        if check is None:
            raise bad_request("this backend serves no LoRA adapters", "name")
        try:
            await maybe_await(check(lora))
        except ValueError as e:
            raise bad_request(f"LoRA adapter {lora.path!r}: {str(e)[:500]}", "path") from None

    async def load_lora(self, name: str, path: str, tenants: list[str] | None) -> dict:
        """Serve the adapter at `path` as model `name` (to `tenants`; None: all), once the
        backend has read and validated it: a 400 with the reason, and nothing changed, when
        it cannot; a 409 when `name` is loaded already."""
        unknown = sorted(set(tenants or ()) - set(self.registry.tenants))
        if unknown:
            raise bad_request(f"unknown tenants {unknown}", "tenants")
        entry = self.loras.entry(name, path, tenants)
        await self.check_lora(entry.lora)
        self.loras.add(entry)
        try:
            await self.lora_changed(name, entry.lora, entry.tenants)
        except Exception:
            self.loras.remove(name)
            log.error("the backend did not keep LoRA adapter %s", name, exc_info=True)
            raise ApiError(502, "the backend refused the adapter", type="server_error") from None
        log.info("loaded LoRA adapter %s from %s", name, path)
        return entry.public()

    async def lora_changed(self, name: str, lora: Any, tenants: frozenset[str] | None) -> None:
        """Tell a backend shared by several ingresses (the cluster's controller keeps it for
        the others and for restarts): `lora` None, unloaded."""
        hook = getattr(self.backend, "lora_changed", None)
        if hook is not None:
            await maybe_await(hook(name, lora, tenants))

    async def unload_lora(self, name: str) -> dict:
        """Stop serving adapter `name`: new requests for it get 404 from now on; requests
        already accepted run to their end under it, after which the engines drop it."""
        entry = self.loras.remove(name)
        log.info("unloaded LoRA adapter %s", name)
        try:
            await self.lora_changed(name, None, None)
        except Exception:  # unloaded here; the other ingresses may serve it until a restart
            log.error("the backend did not keep the unload of LoRA adapter %s", name, exc_info=True)
        remove = getattr(self.backend, "remove_lora", None)
        if remove is not None:
            try:
                await maybe_await(remove(entry.lora))
            except Exception:  # (it is not served any more; a replica keeps a copy until restart)
                log.warning("engines did not drop LoRA adapter %s", name, exc_info=True)
        return {**entry.public(), "deleted": True}

    async def check_configured_loras(self) -> None:
        """The configured adapters, checked once a backend is bound: a broken one is dropped
        (and logged), the others are served."""
        for entry in list(self.loras.entries.values()):
            try:
                await self.check_lora(entry.lora)
            except ApiError as e:
                log.error("LoRA adapter %s is not served: %s", entry.name, e.message)
                self.loras.remove(entry.name)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            if len(text) > TOKENIZE_IN_THREAD_CHARS:
                return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens)
            return self.tokenizer.encode(text, add_special_tokens)
        except Exception:
            raise bad_request("the prompt could not be tokenized", "prompt") from None

    def check_ids(self, ids: list[int]) -> list[int]:
        vocab = self.tokenizer.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise bad_request(f"prompt token ids must be in [0, {vocab})", "prompt")
        return ids

    def max_tokens(self, n_prompt: int, requested: int | None, default: int) -> int:
        limit = self.max_model_len
        if n_prompt == 0:
            raise bad_request("the prompt is empty after tokenization", "prompt")
        if n_prompt >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens, and the prompt has "
                f"{n_prompt} tokens (at least one token must be left for the completion)",
                "prompt",
                "context_length_exceeded",
            )
        if requested is None:
            return min(default, limit - n_prompt)
        if n_prompt + requested > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n_prompt + requested} tokens ({n_prompt} in the prompt, {requested} for the "
                f"completion). Reduce the prompt or max_tokens.",
                "max_tokens",
                "context_length_exceeded",
            )
        return requested

    # -- running a request ---------------------------------------------------------------------

    def admit(
        self, tenant: TenantState, prefix: str, n_prompt: int, request_id: str | None = None
    ) -> Admission:
        rid = request_id or prefix + secrets.token_urlsafe(18)  # "cmpl-...": the reply's id
        try:
            return self.registry.admit(tenant, rid, n_prompt, S.now())
        except Rejected as r:
            raise self.rejection(tenant, r) from None

    @staticmethod
    def rejection(tenant: TenantState, r: Rejected) -> ApiError:
        log.info("rejected tenant=%s status=%d code=%s", tenant.name, r.status, r.code)
        return ApiError(
            r.status,
            r.message,
            type="rate_limit_error" if r.status == 429 else "server_error",
            code=r.code,
            headers={"Retry-After": str(r.retry_after)},
        )

    async def launch(
        self,
        request: Request | None,
        tenant: TenantState,
        prefix: str,
        jobs: list[tuple[list, Any]],
        *,
        model: str | None = None,
        request_id: str | None = None,
        priority: int | None = None,
    ) -> list[tuple[Admission, AsyncIterator[Any], Any, int, int]]:
        """Admit and start every sample of every job (prompt ids, params with `n` samples), all
        or nothing: the one way in for HTTP and handle calls. Sample 0 of each job starts
        first; its siblings then fork from it (`fork_of`: they share its prompt's KV blocks) and
        are not charged the prompt again. `request`: the HTTP request, whose disconnect cancels
        the wait for a first token (None: a handle call, cancelled by its caller). `model`: the
        id it named (usage records); `request_id` (one job, n=1) and `priority` (the tenant's
        otherwise): a handle caller's. Returns (ticket, stream, first delta, job, sample), job
        by job, sample by sample; ApiError when it could not start."""
        plan = [(j, i) for j, (_, params) in enumerate(jobs) for i in range(params.n)]
        bound = self.registry.max_in_flight(tenant)
        if len(plan) > bound:  # could never be admitted: no point in retrying
            n = jobs[0][1].n
            raise bad_request(
                f"this request needs {len(plan)} requests in flight at once ({len(jobs)} "
                f"prompt(s) x n={n}), more than tenant {tenant.name!r} may have ({bound}); "
                "send fewer prompts or a smaller n",
                "n" if n > 1 else "prompt",
                "too_many_requests_in_one",
            )
        tickets: dict[tuple[int, int], Admission] = {}
        try:
            for j, i in plan:
                n_prompt = len(jobs[j][0]) if i == 0 else 0
                tickets[j, i] = self.admit(tenant, prefix, n_prompt, request_id)
                tickets[j, i].response_id = tickets[plan[0]].request_id  # the reply's id
                tickets[j, i].model = model or self.model_name
        except ApiError:
            for t in tickets.values():  # the admitted part is given back
                self.registry.release(t)
                self.registry.refund(t)
            raise
        started: dict[tuple[int, int], Any] = {}
        for phase in ([k for k in plan if k[1] == 0], [k for k in plan if k[1] > 0]):
            results = await asyncio.gather(
                *(
                    self.start(
                        request,
                        tickets[k],
                        jobs[k[0]][0],
                        jobs[k[0]][1].for_sample(k[1]),
                        fork_of=tickets[k[0], 0].request_id if k[1] else None,
                        priority=priority,
                    )  # fmt: skip
                    for k in phase
                ),
                return_exceptions=True,
            )
            started.update(zip(phase, results))
            failed = next((e for e in results if isinstance(e, BaseException)), None)
            if failed is not None:  # each failed start released its own ticket
                for k in plan:
                    got = started.get(k)
                    if got is None:  # never started
                        self.registry.release(tickets[k])
                        self.registry.refund(tickets[k])
                    elif not isinstance(got, BaseException):
                        await close_stream(got[0])
                        self.registry.release(tickets[k])
                        self.finish_log(tickets[k], "error")
                raise failed
        return [(tickets[k], *started[k], *k) for k in plan]

    async def start(
        self,
        request: Request | None,
        ticket: Admission,
        prompt_ids: list[int],
        params: Any,
        fork_of: str | None = None,
        priority: int | None = None,
    ) -> tuple[AsyncIterator[Any], Any]:
        """Submit and wait for the first delta (watching for a disconnect meanwhile)."""
        # Only a tenant in a prefix-cache group passes a salt, and only a sibling sample
        # `fork_of`: backends that predate these kwargs keep working.
        salt = ticket.tenant.cache_salt
        extra = {} if salt is None else {"cache_salt": salt}
        if fork_of is not None:
            extra["fork_of"] = fork_of
        self.metrics.started(ticket)
        it = self.backend.generate(
            prompt_ids,
            params,
            request_id=ticket.request_id,
            tenant=ticket.tenant.name,
            priority=ticket.tenant.priority if priority is None else priority,
            **extra,
        )
        try:
            if request is None:
                first = await it.__anext__()
            else:
                first = await until_disconnect(request, it.__anext__())
            if first.finished and first.finish_reason == "error" and not first.token_ids:
                raise RuntimeError("the backend failed the request before its first token")
            self.metrics.first_token(ticket, first)
        except BaseException as e:
            await close_stream(it)
            self.registry.release(ticket)
            if isinstance(e, ClientGone):
                self.finish_log(ticket, "client_gone")
                raise
            if isinstance(e, Rejected):  # over a cluster-wide limit (the controller's)
                self.registry.refund(ticket)
                self.registry.count_rejection(ticket.tenant)
                self.record_usage(ticket, "refused")
                raise self.rejection(ticket.tenant, e) from None
            if isinstance(e, ValueError):
                self.registry.refund(ticket)
                raise bad_request(str(e)[:500]) from None
            if isinstance(e, StopAsyncIteration):
                e = RuntimeError("the backend stream ended without output")
            if isinstance(e, Exception):
                log.warning("backend failed request_id=%s: %s", ticket.request_id, type(e).__name__)
                self.finish_log(ticket, "error")
                raise self.backend_error(ticket) from None
            raise
        return it, first

    def backend_error(self, ticket: Admission) -> ApiError:
        if ticket.cancelled:
            return ApiError(409, "the request was cancelled", code="request_cancelled")
        return self.unavailable("the model backend failed to serve this request; retry later")

    def finish_log(self, ticket: Admission, outcome: str) -> None:
        """The request ended: `outcome` "ok" (its finish reason is the ticket's), or how it
        was cut ("client_gone", "error", ...)."""
        self.metrics.finished(ticket, outcome)
        log.info(
            "request_id=%s tenant=%s outcome=%s prompt_tokens=%d completion_tokens=%d",
            ticket.request_id,
            ticket.tenant.name,
            outcome,
            ticket.prompt_tokens,
            ticket.completion_tokens,
        )
        self.record_usage(ticket, (ticket.finish_reason or "stop") if outcome == "ok" else outcome)

    def record_usage(self, ticket: Admission, finish_reason: str) -> None:
        """The request's usage record, once, to the usage log (when one is kept)."""
        if self.usage is None or ticket.meta.get("recorded"):
            return
        ticket.meta["recorded"] = True
        t = ticket
        record = UsageRecord(
            t.request_id, t.response_id or t.request_id, t.tenant.name,
            t.model or self.model_name, t.prompt_tokens, t.cached_tokens,
            t.completion_tokens, t.reasoning_tokens, finish_reason, t.arrival,
            t.first_token, time.time(), t.replica, t.preemptions, t.moves,
        )  # fmt: skip
        try:
            self.usage([record])
        except Exception:  # a full disk must not fail the request; the log says it
            log.error("usage record of request_id=%s not written", t.request_id, exc_info=True)

    async def usage_summary(self, tenant: str | None, since: float, until: float) -> dict:
        """Per-tenant sums over the usage log (the backend's, a cluster's, or this app's)."""
        if self.config.usage is None:
            raise ApiError(
                404, "usage records are off: set `usage.path` in the app config",
                code="usage_disabled",
            )  # fmt: skip
        if self.usage_log is not None:
            return await asyncio.to_thread(self.usage_log.summary, tenant, since, until)
        return await maybe_await(self.backend.usage_summary(tenant, since, until))


def create_app(
    backend: Any,
    config: AppConfig | dict | None = None,
    *,
    clock: Callable[[], float] = time.monotonic,
    shared_limits: bool = False,
) -> FastAPI:
    """The OpenAI-compatible app over `backend` (see `openai_api` for the protocol).

    `backend` may be None: the API answers 503 until `bind_backend(app, backend)`.
    `config`: an `AppConfig` or its dict form (None = the embedded default: anonymous access,
    no admin key). `clock` drives the quota buckets (tests inject one). `shared_limits`: the
    backend serves several ingresses and enforces the tenants' quotas and in-flight bounds over
    all of them (a cluster's controller); this app then leaves them to it.

    `app.state.api` holds the live state; `app.state.registry` the tenants and counters.
    """
    api = _Api(backend, parse_config(config), clock, shared_limits)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if api.backend is not None:
            await api.push_tenants()
            await api.check_configured_loras()
        yield

    app = FastAPI(title="fairbatch", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.api = api
    app.state.registry = api.registry
    for exc_class, handler in _ERROR_HANDLERS.items():
        app.add_exception_handler(exc_class, handler)
    app.include_router(routes.router)  # health, models, the caller's own requests, admin
    app.include_router(generation.router)  # completions, chat completions, responses
    add_metrics_route(app, api)  # GET /metrics (see prometheus.py)
    return app


# ---- errors: every one in OpenAI's shape ---------------------------------------------------------


async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return error_response(exc)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    msg, param = validation_message(list(exc.errors()))
    return error_response(bad_request(msg, param))


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    err = ApiError(exc.status_code, str(exc.detail), type=kind, code=None)
    err.headers = dict(exc.headers or {})
    return error_response(err)


async def _gone(request: Request, exc: ClientGone) -> JSONResponse:
    return error_response(ApiError(499, "client closed the request", code="client_gone"))


async def _internal(request: Request, exc: Exception) -> JSONResponse:
    log.error("internal error on %s: %s", request.url.path, type(exc).__name__, exc_info=exc)
    return error_response(
        ApiError(500, "internal server error", type="server_error", code="internal_error")
    )


_ERROR_HANDLERS: dict[Any, Callable] = {
    ApiError: _api_error,
    RequestValidationError: _validation_error,
    StarletteHTTPException: _http_error,
    ClientGone: _gone,
    Exception: _internal,
}


async def bind_backend(app: FastAPI, backend: Any) -> None:
    """Attach `backend` to an app made by `create_app(None, config)` (until then the API
    answers 503), and push the configured tenants to it. For hosts, such as a Serve ingress,
    that must build the app before the backend exists."""
    api: _Api = app.state.api
    api.bind(backend)
    await api.push_tenants()
    await api.check_configured_loras()
