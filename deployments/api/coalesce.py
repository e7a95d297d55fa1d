"""Stream coalescing at the ingress: a request's deltas that arrive within `interval_s` of the
last chunk sent leave as one chunk.

Every chunk costs the serving plane the same (a JSON body, an SSE event, a hop through the
HTTP proxy) whether it carries one token or ten, so sending fewer, larger chunks is what keeps
the CPU for the replicas. A request's first delta leaves at once (TTFT is not delayed), and a
delta that follows a pause longer than the interval leaves at once too; only deltas that come
faster than the interval are merged. Ray Serve LLM does the same with a 50 ms default
(`stream_batching_interval_ms`).

Whatever the interval, a delta whose text the detokenizer held back (its tokens end inside a
UTF-8 character, or may start a stop string) is merged into the next one that has text, so a
chunk's logprobs always belong to the text of the same chunk and no chunk carries tokens
without their text.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fairbatch.engine.outputs import RequestDelta


def merge(deltas: list[Any]) -> Any:
    """One delta with the tokens, text and logprobs of `deltas` (in order); finished as the
    last one is; the first delta's prompt log-probs and cached-token count, wherever they are;
    the last one's replica, preemption and move counts."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    tokens: list[int] = []
    records: list[Any] = []
    for d in deltas:
        tokens.extend(d.token_ids)
        lps = getattr(d, "logprobs", None)
        if lps:
            records.extend(lps)
    text = "".join(d.text for d in deltas)
    merged = RequestDelta(
        last.request_id, tokens, text, last.finished, last.finish_reason, records or None
    )
    for name in ("prompt_logprobs", "num_cached_tokens"):
        merged_value = next(
            (v for v in (getattr(d, name, None) for d in deltas) if v is not None), None
        )
        setattr(merged, name, merged_value)
    for name in ("num_preemptions", "replica_id", "num_moves"):  # the last delta's
        setattr(merged, name, getattr(last, name, None))
    return merged


def _chunks(deltas: list[Any]) -> list[Any]:
    """`deltas` as one merged delta; but an ending that is a failure ("abort", "error") stays a
    delta of its own, so the text before it still reaches the client."""
    last = deltas[-1]
    if len(deltas) > 1 and last.finished and last.finish_reason in ("abort", "error"):
        return [merge(deltas[:-1]), last]
    return [merge(deltas)]


def _ready(pending: list[Any]) -> bool:
    """Whether the pending deltas may leave: they end the request, or carry text (tokens
    whose text is held back wait for it)."""
    last = pending[-1]
    return last.finished or any(d.text for d in pending) or not any(d.token_ids for d in pending)


async def coalesce(
    deltas: AsyncIterator[Any], interval_s: float, clock=None, sleep=asyncio.sleep
) -> AsyncIterator[Any]:
    """`deltas` merged as described above. Closing this iterator stops reading `deltas`: a
    read in progress is cancelled, and with an interval `deltas` is closed here (its reader
    is a task of its own); without one the caller closes it. `clock` and `sleep` (the loop's
    by default) are for tests."""
    if interval_s <= 0:
        pending: list[Any] = []
        async for d in deltas:
            pending.append(d)
            if _ready(pending):
                for chunk in _chunks(pending):
                    yield chunk
                pending = []
        if pending:
            for chunk in _chunks(pending):
                yield chunk
        return
    loop = asyncio.get_running_loop()
    now = clock or loop.time
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    stopping = False

    async def pump() -> None:
        try:
            async for d in deltas:
                queue.put_nowait(d)
                if stopping:
                    break
        except Exception as e:  # raised to the reader in order
            queue.put_nowait(e)
        finally:
            # Stopped early: close what it read here, where nothing else iterates it. (Its
            # cancellation alone is not enough: asyncio.wait_for in Python 3.11 swallows a
            # cancel that coincides with a result, and a pump left running would read the
            # request to its end.)
            if stopping:
                with contextlib.suppress(Exception):
                    await deltas.aclose()
        queue.put_nowait(done)

    def is_end(item: Any) -> bool:
        return item is done or isinstance(item, Exception)

    def drain(into: list[Any]) -> bool:
        """Move what has arrived into `into`; True when the end (or an error) is among it."""
        while not queue.empty():
            item = queue.get_nowait()
            into.append(item)
            if is_end(item):
                return True
        return False

    reader = loop.create_task(pump())
    last_sent: float | None = None
    pending = []
    try:
        while True:
            pending.append(await queue.get())
            ended = is_end(pending[-1]) or drain(pending)
            if not ended and last_sent is not None and not pending[-1].finished:
                wait = last_sent + interval_s - now()
                if wait > 0:
                    await sleep(wait)
                    ended = drain(pending)
            body = pending[:-1] if ended else pending
            if not ended and not _ready(body):
                continue  # held-back text: wait for the delta that releases it
            if body:
                for chunk in _chunks(body):
                    yield chunk
                last_sent = now()
            tail, pending = pending[-1], []
            if isinstance(tail, Exception):
                raise tail
            if tail is done:
                return
    finally:
        stopping = True
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await reader
