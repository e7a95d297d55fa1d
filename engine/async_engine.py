"""AsyncEngine: the step loop in the background, requests as async streams of deltas.

Every touch of the EngineCore (steps, adds, aborts, controller hooks) runs on one dedicated
thread, so the core needs no locks and the event loop stays free while a forward runs. The
step loop itself runs on that thread: the next step starts as soon as one ends (after the calls
that came in meanwhile), and the event loop hands the deltas out while it runs - no round trip
through the event loop between two steps. Ahead of the delivery by at most
`MAX_UNDELIVERED_STEPS` steps.

Two ways out: `generate`/`resume` give one async stream per request (a local server), or a
`sink` gets every step's deltas of the requests added with `add` as one list (the Ray replica,
which sends each consumer one message per step, not one per token per request).

`AsyncEngine.build(factory)` builds the core on the engine thread itself, so that one thread
does all of a process's torch work. On CPU this matters: torch's OpenMP runtime keeps a team of
worker threads for every thread that has run a parallel op, and once the teams' threads
outnumber the cores, GNU OpenMP stops letting idle workers spin between ops and puts them to
sleep at once: a model loaded on an actor's main thread (which lives on) and stepped on this
one took about 20% longer a step on 2 cores.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import threading
import uuid
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

from fairbatch.engine.core import EngineCore
from fairbatch.engine.outputs import RequestDelta
from fairbatch.engine.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The step loop failed or was shut down; every open stream ends with this error."""


class AsyncEngine:
    # Steps whose deltas may wait for the event loop at once: the engine runs at most this far
    # ahead of the delivery, so a slow event loop holds the steps back instead of piling up
    # callbacks (and memory) behind it.
    MAX_UNDELIVERED_STEPS = 2

    def __init__(
        self,
        engine: EngineCore,
        step_hook: Callable[[], Any] | None = None,
        sink: Callable[[list[RequestDelta] | BaseException], Any] | None = None,
    ) -> None:
        self.engine = engine
        # called on the event loop with each step's deltas of requests added by `add` (not
        # streamed by `generate`), or once with the exception that stopped the steps
        self._sink = sink
        self._step_hook = step_hook  # called on the engine thread after each step (pacing)
        self.step_clock: Any = None  # times each step when set: begin(), then stop() -> times
        self.num_steps = 0  # steps run (on the engine thread, which may be ahead of delivery)
        # Set on the event loop while a step's deltas are handed out: that step's number and
        # its times from `step_clock` (None without one).
        self.delivered_step = 0
        self.delivered_times: Any = None
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # where the deltas go
        self._thread: threading.Thread | None = None
        # Guards what the two threads share: the calls waiting for the engine thread, the
        # steps not yet delivered, the stop flag.
        self._cond = threading.Condition()
        self._calls: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future]] = (
            collections.deque()
        )
        self._undelivered = 0
        self._stopping = False
        self._error: BaseException | None = None  # what the step that failed raised

    # ---- lifecycle --------------------------------------------------------------------------

    @classmethod
    def build(cls, factory: Callable[[], EngineCore], **kwargs: Any) -> AsyncEngine:
        """An AsyncEngine over `factory()`, called on the engine thread (which then runs the
        steps); raises what the factory raises. `kwargs`: as for the constructor."""
        self = cls(None, **kwargs)  # type: ignore[arg-type]
        built: concurrent.futures.Future = concurrent.futures.Future()
        self._start_thread(factory, built)
        built.result()
        return self

    def _ensure_started(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        if self._thread is None:
            self._start_thread()

    def _start_thread(self, *args: Any) -> None:
        self._thread = threading.Thread(target=self._run, args=args, name="engine")
        _LIVE.add(self)
        self._thread.start()

    async def shutdown(self) -> None:
        """Stop the engine thread (after the step it is in) and end the open streams."""
        self._stop()
        thread = self._thread
        if thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, thread.join)
        dead = EngineDeadError("the engine was shut down")
        for queue in self._streams.values():
            queue.put_nowait(dead)

    def _stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run `fn(*args)` on the engine thread, between steps (in the order called)."""
        return await self._call(functools.partial(fn, *args, **kwargs))

    async def _call(self, fn: Callable[[], Any]) -> Any:
        self._ensure_started()
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._stopping:
                raise EngineDeadError("the engine was shut down")
            self._calls.append((fn, future))
            self._cond.notify()
        return await asyncio.wrap_future(future)

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
        request = migrated.request
        add = functools.partial(self.engine.import_request, migrated)
        async for delta in self._stream(request.request_id, add):
            yield delta

    async def add(self, add: Callable[[], Any]) -> Any:
        """Run `add` (EngineCore adds/imports) on the engine thread; the requests' deltas go to
        the sink. Returns what `add` returns, raises what it raises."""
        self._ensure_started()
        if self._error is not None:
            raise EngineDeadError(str(self._error))
        return await self._call(add)

    async def _stream(self, rid: str, add: Callable[[], Any]) -> AsyncIterator[RequestDelta]:
        if rid in self._streams:
            raise ValueError(f"duplicate request id {rid!r}")
        # Register before adding: the first step may finish before this coroutine resumes.
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = queue
        try:
            await self._call(add)
        except BaseException:
            self._streams.pop(rid, None)
            raise
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

    # ---- the engine thread -------------------------------------------------------------------

    def _run(self, factory: Callable[[], EngineCore] | None = None, built: Any = None) -> None:
        """The engine thread: the calls waiting, then a step while there is work, in a loop. The
        next step starts as soon as this one ends; its deltas reach the event loop meanwhile.
        After a failed step it only runs calls (aborts, stats), until stopped. With a
        `factory`, it first builds the engine (`build`), and ends if that raises."""
        if factory is not None:
            try:
                self.engine = factory()
            except BaseException as e:
                built.set_exception(e)
                return
            built.set_result(None)
        while True:
            with self._cond:
                while not (self._stopping or self._calls or self._may_step()):
                    self._cond.wait()
                if self._stopping:
                    break
                calls = list(self._calls)
                self._calls.clear()
            for fn, future in calls:
                if future.set_running_or_notify_cancel():  # (not if its caller went away)
                    try:
                        future.set_result(fn())
                    except BaseException as e:
                        future.set_exception(e)
            with self._cond:
                if not self._may_step():
                    continue
                self._undelivered += 1
            times = None
            try:
                deltas: list[RequestDelta] | BaseException
                deltas, times = self._step()
            except BaseException as e:  # no stream may hang waiting for it
                self._error = deltas = e
            if not self._post(deltas, self.num_steps, times):
                break
        with self._cond:  # stopped: what was still to run fails, and so will any new call
            self._stopping = True
            calls = list(self._calls)
            self._calls.clear()
        for _, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineDeadError("the engine was shut down"))

    def _may_step(self) -> bool:
        return (
            self._error is None
            and self._loop is not None  # (set by the first async call; `build` starts without)
            and self._undelivered < self.MAX_UNDELIVERED_STEPS
            and self.engine.has_unfinished()
        )

    def _step(self) -> tuple[list[RequestDelta], Any]:
        clock = self.step_clock
        if clock is not None:
            clock.begin()
        deltas = self.engine.step()
        times = clock.stop() if clock is not None else None
        self.num_steps += 1
        if self._step_hook is not None:
            self._step_hook()
        return deltas, times

    def _post(self, deltas: list[RequestDelta] | BaseException, step: int, times: Any) -> bool:
        """Hand a step's deltas (or its exception) to the event loop; False once it is closed."""
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._deliver, deltas, step, times)
        except RuntimeError:  # the event loop is closed: nobody is left to stream to
            return False
        return True

    def _deliver(self, deltas: list[RequestDelta] | BaseException, step: int, times: Any) -> None:
        """On the event loop: a step's deltas to their streams, the rest to the sink."""
        with self._cond:
            self._undelivered -= 1
            self._cond.notify()
        self.delivered_step, self.delivered_times = step, times
        if isinstance(deltas, BaseException):
            for queue in self._streams.values():
                queue.put_nowait(deltas)
            if self._sink is not None:
                self._sink(deltas)
            return
        rest: list[RequestDelta] = []
        for delta in deltas:
            queue = self._streams.get(delta.request_id)
            if queue is not None:
                queue.put_nowait(delta)
            else:
                rest.append(delta)
        if rest and self._sink is not None:
            self._sink(rest)


# Engines whose thread runs: stopped when the interpreter exits, as a thread pool's workers are
# (before non-daemon threads are joined), so that none is inside a step while Python finalizes.
_LIVE: weakref.WeakSet[AsyncEngine] = weakref.WeakSet()


def _stop_all() -> None:
    for engine in list(_LIVE):
        engine._stop()
    for engine in list(_LIVE):
        if engine._thread is not None and engine._thread is not threading.current_thread():
            engine._thread.join(timeout=10)


threading._register_atexit(_stop_all)  # type: ignore[attr-defined]
