"""HTTP plumbing for the API: bounded body reading, OpenAI-shaped validation errors, and
disconnect-aware waiting and streaming.

The one rule here: a request whose client has gone must not keep running. `until_disconnect`
cancels what it awaits when the client leaves, and `SSEResponse` closes its iterator (and so
the backend stream, which aborts the request) whether the stream ended, failed or was cut.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from fairbatch.deployments.api.schemas import ApiError, bad_request

log = logging.getLogger("fairbatch.api")


class ClientGone(Exception):
    """The client disconnected before the response started."""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON: 413 past `limit` bytes (checked before parsing), 400 if not UTF-8 or
    not JSON (NaN and Infinity included)."""
    too_large = ApiError(
        413, f"request body exceeds {limit} bytes", code="request_too_large", param=None
    )
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise bad_request("invalid Content-Length header")
        if int(declared) > limit:
            raise too_large
    buf = bytearray()
    try:
        async for chunk in request.stream():
            buf += chunk
            if len(buf) > limit:
                raise too_large
    except ClientDisconnect:
        raise ClientGone() from None
    try:
        text = bytes(buf).decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        data = json.loads(text, parse_constant=_reject_constant)
        # Lone surrogates ("\ud800") parse but are no text: refuse them here, not in the
        # tokenizer.
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except (ValueError, RecursionError) as e:
        raise bad_request(f"request body is not valid JSON: {e}"[:300]) from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object")
    return data


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    parts, param = [], None
    for e in errors[:3]:
        loc = ".".join(str(p) for p in e.get("loc", ()) if p not in ("body",))
        param = param or loc or None
        msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
        if e.get("type") == "missing":
            parts.append(f"missing required field '{loc}'")
        elif e.get("type") == "extra_forbidden":
            parts.append(f"unsupported field '{loc}': this server does not implement it")
        else:
            parts.append(f"{loc}: {msg}" if loc and not msg.startswith(loc) else msg)
    more = len(errors) - 3
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else ""), param


def validate(model: type[BaseModel], data: Any) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        msg, param = validation_message(e.errors(include_url=False, include_input=False))
        raise bad_request(msg, param) from None


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


async def _wait_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    while True:
        message = await receive()
        if message.get("type") == "http.disconnect":
            return


async def until_disconnect(request: Request, awaitable: Awaitable[Any]) -> Any:
    """Await `awaitable` unless the client disconnects first: then cancel it, raise ClientGone."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            try:
                await task
            except BaseException:
                pass
        watcher.cancel()
    if task.cancelled():
        raise ClientGone()
    return task.result()


class SSEResponse(StreamingResponse):
    """A stream that always watches for the client leaving, and always closes its iterator.

    Starlette's StreamingResponse, under ASGI spec >= 2.4, notices a disconnect only when a
    send fails and leaves the iterator to the garbage collector; a stream waiting for its next
    token would hold its KV blocks until then.
    """

    media_type = "text/event-stream"

    def __init__(self, content: Any, on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass  # the client went away mid-send
                    tg.cancel_scope.cancel()

                async def watch() -> None:
                    await _wait_disconnect(receive)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                tg.start_soon(watch)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[union-attr]
                await self.on_close()  # also when the iterator never started


def sse(data: dict | str) -> str:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n"


async def close_stream(it: Any) -> None:
    """Close a backend stream (aborting its request unless it finished). A stream that another
    task is inside right now (reading it, or closing it) is left to that task, which closes it
    when it gets out: a response closes its stream from two places on purpose
    (deployments/api/responses.py), and one of them finds it so at the end of most streams."""
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        with anyio.CancelScope(shield=True):
            try:
                await aclose()
            except RuntimeError as e:
                if "already running" not in str(e):
                    log.warning("closing a backend stream failed", exc_info=True)
            except Exception:  # closing must not mask the original outcome
                log.warning("closing a backend stream failed", exc_info=True)
