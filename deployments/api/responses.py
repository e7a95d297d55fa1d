"""One admitted request after its first delta: backend deltas -> OpenAI response bodies.

`ResponseRun.complete()` collects a whole completion (cancelled if the client leaves);
`ResponseRun.stream()` yields SSE chunks shaped as OpenAI's (`chat.completion.chunk` or
`text_completion`), with a usage chunk at the end when asked, an error event if the backend
fails or the request is cancelled, and `data: [DONE]` last. `close()` releases the request's
slot and closes the backend stream exactly once, whichever way the response ended.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from fairbatch.deployments.api import schemas as S
from fairbatch.deployments.api.coalesce import coalesce
from fairbatch.deployments.api.http import ClientGone, close_stream, sse, until_disconnect
from fairbatch.deployments.api.schemas import ApiError
from fairbatch.deployments.api.tenants import Admission

log = logging.getLogger("fairbatch.api")


class ResponseRun:
    """One admitted request after its first delta: turns deltas into OpenAI bodies."""

    def __init__(
        self, api: Any, ticket: Admission, it: Any, first: Any, *, chat: bool, top_n: int | None
    ) -> None:
        self.api = api
        self.ticket = ticket
        self.it = it
        self.first = first
        self.chat = chat
        self.top_n = top_n  # None = no logprobs
        self.text_len = 0
        self.created = ticket.created
        self.object = "chat.completion" if chat else "text_completion"
        self.outcome = "client_gone"
        self.closed = False

    async def close(self) -> None:
        """Release the request's slot and close the backend stream (aborting it unless it
        finished). Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.api.registry.release(self.ticket)
        self.api.finish_log(self.ticket, self.outcome)
        await close_stream(self.it)

    async def deltas(self) -> AsyncIterator[Any]:
        """The first delta, then the backend's; closing this closes the backend stream (which
        aborts the request unless it finished)."""
        try:
            yield self.first
            async for d in self.it:
                yield d
        finally:
            await close_stream(self.it)

    def account(self, delta: Any) -> None:
        self.ticket.charge(len(delta.token_ids))
        if delta.finished:
            self.ticket.finished = True
            self.ticket.finish_reason = delta.finish_reason

    def outcome_error(self, reason: str | None) -> ApiError | None:
        if reason in ("abort", "error"):
            return self.api.backend_error(self.ticket)
        return None

    def logprobs(self, records: list[Any]) -> Any:
        fmt = self.api.logprobs
        if self.chat:
            return {"content": fmt.chat(records, self.top_n or 0)}
        return fmt.completion(records, self.top_n or 0, self.text_len)

    async def complete(self, request: Request) -> JSONResponse:
        try:
            return await until_disconnect(request, self._collect())
        except (ApiError, ClientGone):
            raise
        except Exception as e:  # the backend failed mid-way: 503, not 500
            self.outcome = "error"
            log.warning(
                "backend failed request_id=%s: %s", self.ticket.request_id, type(e).__name__
            )
            raise self.api.backend_error(self.ticket) from None
        finally:
            await self.close()

    async def _collect(self) -> JSONResponse:
        text, records, reason = [], [], None
        async for d in self.deltas():
            self.account(d)
            text.append(d.text)
            lps = getattr(d, "logprobs", None)
            if self.top_n is not None and lps:
                records.extend(lps)
            if d.finished:
                reason = d.finish_reason
                break
        err = self.outcome_error(reason)
        if err is not None:
            self.outcome = reason or "error"
            raise err
        t = self.ticket
        out_text = "".join(text)
        lp = self.logprobs(records) if self.top_n is not None else None
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": out_text}}
        else:
            choice = {"index": 0, "text": out_text}
        choice.update(logprobs=lp, finish_reason=S.finish_reason(reason))
        self.outcome = "ok"
        return JSONResponse(
            {
                "id": t.request_id,
                "object": self.object,
                "created": self.created,
                "model": self.api.model_name,
                "choices": [choice],
                "usage": S.usage(t.prompt_tokens, t.completion_tokens),
            }
        )

    def chunk(self, choice: dict | None, include_usage: bool, usage: dict | None = None) -> str:
        body: dict[str, Any] = {
            "id": self.ticket.request_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.api.model_name,
            "choices": [] if choice is None else [choice],
        }
        if include_usage:
            body["usage"] = usage
        return sse(body)

    def choice(self, text: str, records: list[Any] | None, reason: str | None) -> dict:
        lp = self.logprobs(records) if self.top_n is not None and records else None
        if self.chat:
            delta = {"content": text} if text or reason is None else {}
            c: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            c = {"index": 0, "text": text}
        c.update(logprobs=lp, finish_reason=S.finish_reason(reason))
        self.text_len += len(text)
        return c

    async def stream(self, include_usage: bool) -> AsyncIterator[str]:
        t = self.ticket
        merged = None
        try:
            if self.chat:
                role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
                yield self.chunk(dict(role, logprobs=None, finish_reason=None), include_usage)
            interval_s = self.api.config.stream_interval_ms / 1000.0
            merged = coalesce(self.deltas(), interval_s)
            async for d in merged:
                self.account(d)
                reason = d.finish_reason if d.finished else None
                err = self.outcome_error(reason)
                if err is not None:
                    self.outcome = reason or "error"
                    yield sse(err.body())
                    break
                lps = getattr(d, "logprobs", None)  # optional: cluster items may not carry it
                if d.text or lps or reason is not None:
                    yield self.chunk(self.choice(d.text, lps, reason), include_usage)
                if d.finished:
                    self.outcome = "ok"
                    if include_usage:
                        u = S.usage(t.prompt_tokens, t.completion_tokens)
                        yield self.chunk(None, True, u)
                    break
            yield sse("[DONE]")
        except Exception as e:  # the backend failed mid-stream: say so, then end cleanly
            self.outcome = "error"
            log.warning("stream failed request_id=%s: %s", t.request_id, type(e).__name__)
            yield sse(self.api.backend_error(t).body())
            yield sse("[DONE]")
        finally:
            if merged is not None:
                await merged.aclose()
            await self.close()
