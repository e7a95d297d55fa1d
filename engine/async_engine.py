"""AsyncEngine: the step loop in the background, requests as async streams of deltas.

Every touch of the EngineCore (steps, adds, aborts, controller hooks) runs on one dedicated
thread, so the core needs no locks and the event loop stays free while a forward runs.

Two ways out: `generate`/`resume` give one async stream per request (a local server), or a
`sink` gets every step's deltas of the requests added with `add` as one list (the Ray replica,
which sends each consumer one message per step, not one per token per request).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fairbatch.engine.core import EngineCore, RequestDelta
from fairbatch.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


def lower_thread_priority(niceness: int) -> None:
    """Make the calling thread `niceness` nice levels lower in priority than it is (Linux
    schedules threads one by one; elsewhere, or without the right, it stays as it is)."""
    if niceness <= 0 or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + niceness)
    except OSError as e:
        log.warning("could not lower the engine thread's priority by %d: %r", niceness, e)


class EngineDeadError(RuntimeError):
    """The step loop failed; every open stream ends with this error."""


class AsyncEngine:
    def __init__(
        self,
        engine: EngineCore,
        step_hook: Callable[[], Any] | None = None,
        sink: Callable[[list[RequestDelta] | BaseException], Any] | None = None,
        thread_niceness: int = 0,
    ) -> None:
        self.engine = engine
        # called on the event loop with each step's deltas of requests added by `add` (not
        # streamed by `generate`), or once with the exception that stopped the loop
        self._sink = sink
        # `thread_niceness` > 0 runs the engine thread that many nice levels below its process:
        # where the cores are short, the process's event loop (new requests, the channel) and
        # the serving plane beside it get the CPU first, and the steps take what is left.
        self._thread = concurrent.futures.ThreadPoolExecutor(
            1,
            thread_name_prefix="engine",
            initializer=lower_thread_priority,
            initargs=(thread_niceness,),
        )
        self._streams: dict[str, asyncio.Queue] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._error: BaseException | None = None
        self._step_hook = step_hook  # called on the engine thread after each step (pacing)
        self.step_clock: Any = None  # times each step when set (begin() and stop())
        self.num_steps = 0

    # ---- lifecycle --------------------------------------------------------------------------

    def _ensure_started(self) -> None:
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except BaseException:  # cancelled, or a failed step (every stream and the sink had it)
                pass
            self._task = None
        self._thread.shutdown(wait=True)

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run `fn(*args)` on the engine thread, between steps."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, lambda: fn(*args, **kwargs))

    # ---- requests ---------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[RequestDelta]:
        """Stream the request's deltas until it finishes. Closing the stream aborts it."""
        self._ensure_started()
        if self._error is not None:
            raise EngineDeadError(str(self._error))
        rid = kwargs.pop("request_id", None) or uuid.uuid4().hex
        add = functools.partial(self.engine.add_request, prompt, params, request_id=rid, **kwargs)
        async for delta in self._stream(rid, add):
            yield delta

    async def resume(self, migrated: Any) -> AsyncIterator[RequestDelta]:
        """Adopt a request from another replica and stream its remaining deltas."""
        self._ensure_started()
        add = functools.partial(self.engine.import_request, migrated)
        async for delta in self._stream(migrated.request.request_id, add):
            yield delta

    async def add(self, add: Callable[[], Any]) -> Any:
        """Run `add` (EngineCore adds/imports) on the engine thread; the requests' deltas go to
        the sink. Returns what `add` returns, raises what it raises."""
        self._ensure_started()
        if self._error is not None:
            raise EngineDeadError(str(self._error))
        result = await self.call(add)
        assert self._wake is not None
        self._wake.set()
        return result

    async def _stream(self, rid: str, add: Callable[[], Any]) -> AsyncIterator[RequestDelta]:
        if rid in self._streams:
            raise ValueError(f"duplicate request id {rid!r}")
        # Register before adding: the first step may finish before this coroutine resumes.
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = queue
        try:
            await self.call(add)
        except BaseException:
            self._streams.pop(rid, None)
            raise
        assert self._wake is not None
        self._wake.set()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(str(item)) from item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(rid, None)
            if not finished:  # the caller went away (disconnect, cancel): free its blocks now
                await asyncio.shield(self.call(self.engine.abort, rid))

    async def abort(self, request_id: str) -> bool:
        ok = await self.call(self.engine.abort, request_id)
        queue = self._streams.get(request_id)
        if ok and queue is not None:
            queue.put_nowait(RequestDelta(request_id, [], "", True, "abort"))
        return ok

    # ---- the loop ---------------------------------------------------------------------------

    def _step(self) -> list[RequestDelta]:
        clock = self.step_clock
        if clock is not None:
            clock.begin()
        deltas = self.engine.step()
        if clock is not None:
            clock.stop()
        self.num_steps += 1
        if self._step_hook is not None:
            self._step_hook()
        return deltas

    async def _loop(self) -> None:
        assert self._wake is not None
        try:
            while True:
                if not self.engine.has_unfinished():
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                rest: list[RequestDelta] = []
                for delta in await self.call(self._step):
                    queue = self._streams.get(delta.request_id)
                    if queue is not None:
                        queue.put_nowait(delta)
                    else:
                        rest.append(delta)
                if rest and self._sink is not None:
                    self._sink(rest)
                await asyncio.sleep(0)  # let streams and new requests in between steps
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # a failed step: no stream may hang waiting for it
            self._error = e
            for queue in self._streams.values():
                queue.put_nowait(e)
            if self._sink is not None:
                self._sink(e)
            raise
