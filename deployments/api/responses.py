"""Admitted requests after their first delta: backend deltas -> OpenAI response bodies.

One `ResponseRun` per engine request (a /v1/completions body with a list of prompts has one
per prompt, each a choice with its `index`). `complete_runs()` collects a whole response
(cancelled if the client leaves); `stream_runs()` yields SSE chunks shaped as OpenAI's
(`chat.completion.chunk` or `text_completion`; several prompts' chunks interleave, tagged by
index), with a usage chunk at the end when asked, an error event if a backend stream fails or
a request is cancelled, and `data: [DONE]` last. `ResponseRun.close()` releases the request's
slot and closes its backend stream exactly once, whichever way the response ended.

Echo (completions): the choice's text starts with the prompt and, with `logprobs`, its
log-probs start with the prompt's (the first token's entry null), from the engine's
`prompt_logprobs`. `max_tokens: 0` with echo scores the prompt only: the engine runs one
token, which is dropped and not charged.
"""

from __future__ import annotations

import asyncio
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
        self,
        api: Any,
        ticket: Admission,
        it: Any,
        first: Any,
        *,
        chat: bool,
        top_n: int | None,
        index: int = 0,
        echo: tuple[str, list[int]] | None = None,
        discard_output: bool = False,
        output: Any = None,
        model: str | None = None,
    ) -> None:
        self.api = api
        self.model = model or api.model_name  # the id it named: an adapter's or the base's
        self.ticket = ticket
        self.it = it
        self.first = first
        self.chat = chat
        self.top_n = top_n  # None = no logprobs
        self.index = index
        self.echo = echo  # (prompt text, prompt ids) to put before the completion
        self.discard_output = discard_output  # max_tokens 0: the one engine token is dropped
        # chat: the output's converter into the message (tool calls, reasoning; ChatPlan), or
        # None for plain content
        self.output = output
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
        self.ticket.reasoning_tokens = getattr(self.output, "reasoning_tokens", None) or 0
        self.api.finish_log(self.ticket, self.outcome)
        # The end of deltas() closes it too, on purpose: while the coalescer's reader is inside
        # the stream, this close fails ("already running", logged) and that one does it.
        await close_stream(self.it)

    async def deltas(self) -> AsyncIterator[Any]:
        """The first delta, then the backend's; closing this closes the backend stream (which
        aborts the request unless it finished)."""
        count = getattr(self.output, "count", None)  # a reasoning split counts its tokens
        try:
            if count is not None:
                count(self.first.text, len(self.first.token_ids))
            yield self.first
            async for d in self.it:
                if count is not None:
                    count(d.text, len(d.token_ids))
                yield d
        finally:
            await close_stream(self.it)

    def account(self, delta: Any) -> None:
        if self.discard_output:
            delta.token_ids, delta.text, delta.logprobs = [], "", None
        self.ticket.observe(delta)

    def outcome_error(self, reason: str | None) -> ApiError | None:
        if reason in ("abort", "error"):
            return self.api.backend_error(self.ticket)
        return None

    def logprobs(self, records: list[Any]) -> Any:
        fmt = self.api.logprobs
        if self.chat:
            return {"content": fmt.chat(records, self.top_n or 0)}
        return fmt.completion(records, self.top_n or 0, self.text_len)

    def echoed(self, delta: Any) -> tuple[str, list[Any]]:
        """The prompt's text and log-prob records, for the first delta of an echo run."""
        text, ids = self.echo
        if self.top_n is None:
            return text, []
        scored = getattr(delta, "prompt_logprobs", None)
        if scored is None:
            raise ApiError(
                503, "the backend returned no prompt log-probs", type="server_error",
                code="backend_unavailable",
            )  # fmt: skip
        return text, [[(ids[0], None)], *scored[1:]]

    def usage(self) -> tuple[int, int, int, int | None]:
        """(prompt, completion, cached, reasoning tokens; None where no reasoning parser
        split this output)."""
        t = self.ticket
        reasoning = getattr(self.output, "reasoning_tokens", None)
        return t.prompt_tokens, t.completion_tokens, t.cached_tokens, reasoning

    async def collect(self) -> dict:
        """The whole choice (raises ApiError when the request failed or was cancelled)."""
        text, records, reason = [], [], None
        first = True
        async for d in self.deltas():
            self.account(d)
            if first and self.echo is not None:
                prompt_text, prompt_records = self.echoed(d)
                text.append(prompt_text)
                records.extend(prompt_records)
            first = False
            text.append(d.text)
            lps = getattr(d, "logprobs", None)
            if self.top_n is not None and lps:
                records.extend(lps)
            if d.finished:
                reason = d.finish_reason
                break
        err = self.outcome_error(reason)
        if reason == "timeout" and not self.ticket.completion_tokens:
            msg = "the request's deadline passed before it produced a token"
            err = ApiError(408, msg, type="timeout_error", param="timeout", code="request_timeout")
        if err is not None:
            self.outcome = reason or "error"
            raise err
        out_text = "".join(text)
        lp = self.logprobs(records) if self.top_n is not None else None
        if self.chat:
            choice = {"index": self.index, "message": {"role": "assistant", "content": out_text}}
        else:
            choice = {"index": self.index, "text": out_text}
        choice.update(logprobs=lp, finish_reason=S.finish_reason(reason))
        if self.output is not None:
            choice["message"], choice["finish_reason"] = self.output.message(out_text, reason)
        self.outcome = "ok"
        return choice

    def choice(self, text: str, records: list[Any] | None, reason: str | None) -> dict:
        finish = S.finish_reason(reason)
        if self.output is not None:  # (it may hold text, and the records scoring it)
            delta, finish, records = self.output.delta(text, reason, records)
        elif self.chat:
            delta = {"content": text} if text or reason is None else {}
        lp = self.logprobs(records) if self.top_n is not None and records else None
        if self.chat:
            c: dict[str, Any] = {"index": self.index, "delta": delta}
        else:
            c = {"index": self.index, "text": text}
        c.update(logprobs=lp, finish_reason=finish)
        self.text_len += len(text)
        return c

    async def choices(self) -> AsyncIterator[dict | ApiError]:
        """This run's streamed choices, then nothing; an ApiError item when it failed."""
        merged = None
        try:
            if self.chat:
                yield {"index": self.index, "delta": {"role": "assistant", "content": ""},
                       "logprobs": None, "finish_reason": None}  # fmt: skip
            interval_s = self.api.config.stream_interval_ms / 1000.0
            merged = coalesce(self.deltas(), interval_s)
            first = True
            async for d in merged:
                self.account(d)
                reason = d.finish_reason if d.finished else None
                err = self.outcome_error(reason)
                if err is not None:
                    self.outcome = reason or "error"
                    yield err
                    return
                text, lps = d.text, getattr(d, "logprobs", None)  # cluster items may lack it
                if first and self.echo is not None:
                    prompt_text, prompt_records = self.echoed(d)
                    text = prompt_text + text
                    lps = [*prompt_records, *(lps or [])]
                first = False
                if text or lps or reason is not None:
                    choice = self.choice(text, lps, reason)
                    # no chat chunk with nothing in it (text the output's converter holds)
                    if not self.chat or choice["delta"] or reason is not None or choice["logprobs"]:
                        yield choice
                if d.finished:
                    self.outcome = "ok"
                    return
        except ApiError as e:
            self.outcome = "error"
            yield e
        except Exception as e:  # the backend failed mid-stream
            self.outcome = "error"
            log.warning("stream failed request_id=%s: %s", self.ticket.request_id, type(e).__name__)
            yield self.api.backend_error(self.ticket)
        finally:
            if merged is not None:
                await merged.aclose()
            await self.close()


def _body(runs: list[ResponseRun], choices: list[dict]) -> dict:
    lead = runs[0]
    return {
        "id": lead.ticket.request_id,
        "object": ("chat.completion.chunk" if lead.chat else "text_completion"),
        "created": lead.created,
        "model": lead.model,
        "choices": choices,
    }


def _usage(runs: list[ResponseRun]) -> dict:
    rows = [r.usage() for r in runs]
    totals = [sum(x) for x in zip(*(row[:3] for row in rows))]
    reasoning = [row[3] for row in rows if row[3] is not None]
    return S.usage(*totals, reasoning_tokens=sum(reasoning) if reasoning else None)


async def collect_choices(request: Request, runs: list[ResponseRun]) -> list[dict]:
    """Every run's whole choice, in index order (cancelled if the client leaves); any failure
    fails it all. The runs are closed either way."""

    async def gather() -> list[dict]:
        return list(await asyncio.gather(*(r.collect() for r in runs)))

    try:
        return await until_disconnect(request, gather())
    except (ApiError, ClientGone):
        raise
    except Exception as e:  # a backend failed mid-way: 503, not 500
        for r in runs:
            r.outcome = "error"
        log.warning("backend failed request_id=%s: %s", runs[0].ticket.request_id, type(e).__name__)
        raise runs[0].api.backend_error(runs[0].ticket) from None
    finally:
        for r in runs:
            await r.close()


async def complete_runs(request: Request, runs: list[ResponseRun]) -> JSONResponse:
    """One response with every run's choice, in index order."""
    choices = await collect_choices(request, runs)
    body = _body(runs, choices)
    body["object"] = "chat.completion" if runs[0].chat else "text_completion"
    body["usage"] = _usage(runs)
    return JSONResponse(body)


async def stream_runs(runs: list[ResponseRun], include_usage: bool) -> AsyncIterator[str]:
    """SSE chunks of all runs as they come: one run's in its own order (no task, no queue);
    several runs' through one queue, each chunk tagged with its choice's index."""
    tasks: list[asyncio.Task] = []
    if len(runs) == 1:
        items = runs[0].choices()
    else:
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(run: ResponseRun) -> None:
            try:
                async for item in run.choices():
                    await queue.put(item)
            finally:
                await queue.put(done)

        async def merged() -> AsyncIterator[Any]:
            live = len(runs)
            while live:
                item = await queue.get()
                if item is done:
                    live -= 1
                else:
                    yield item

        tasks = [asyncio.ensure_future(pump(r)) for r in runs]
        items = merged()
    try:
        failed = False
        async for item in items:
            if isinstance(item, ApiError):
                yield sse(item.body())
                failed = True
                break
            body = _body(runs, [item])
            if include_usage:
                body["usage"] = None
            yield sse(body)
        if include_usage and not failed:
            body = _body(runs, [])
            body["usage"] = _usage(runs)
            yield sse(body)
        yield sse("[DONE]")
    finally:
        await items.aclose()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for r in runs:
            await r.close()
