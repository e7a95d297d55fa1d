"""A client process's admissions, batched: one `submit_many` call per burst of requests, one
long-lived `assignments` stream per process and event loop carrying the controller's answers.
Per-request actor calls would cost each client and the controller an actor call per request;
batches amortize that.

Two bounds on the wait: a request the controller has not acknowledged (`submit_many`'s answer)
within `ack_timeout_s` fails with `AdmissionTimeout` (the controller is down, or restarting for
longer than that); one it holds waits in its queue up to the caller's overall `timeout_s` (and
its own `max_queue_time_s`, which the controller enforces). A controller restart voids every
acknowledgement: the requests are submitted again and the bound starts again."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fairbatch.deployments.cluster import trace
from fairbatch.deployments.cluster.wire import RequestMeta

log = logging.getLogger(__name__)
USAGE_FLUSH_S = 1.0  # usage records wait at most this long for a submission to ride with


class AdmissionTimeout(TimeoutError):
    """The fairness controller did not take the request in time (or never answered)."""


@dataclass
class _Pending:
    meta: RequestMeta
    fut: asyncio.Future
    since: float  # loop time the current wait for an acknowledgement began
    acked: bool = False


class AdmissionBatcher:
    """Admissions for one client process and event loop, batched: requests queued within
    `linger_s` go to the controller in one `submit_many` call (one of a class above 0 goes at
    once, with whatever is queued then), and assignments come back on one
    long-lived `assignments` stream (which sends each replica's handle once; the batcher puts
    it back in each Assignment). After any error on that stream (the controller restarted)
    it re-subscribes under a new id and resubmits everything still pending: `submit_many` is
    idempotent per request id and re-sends the assignment of a request already placed."""

    def __init__(
        self,
        controller: Callable[[], Any],
        max_batch: int = 512,
        linger_s: float = 0.001,
        owner: Any = None,
    ) -> None:
        self.controller = controller
        self.owner = owner  # this process's ActorOwner or DriverOwner, for the controller
        self.max_batch = max_batch
        self.linger_s = linger_s
        self.loop = asyncio.get_running_loop()
        self.base_id = uuid.uuid4().hex
        self.generation = 0
        self.pending: dict[str, _Pending] = {}
        self.outbox: list[RequestMeta] = []
        # (request id, output tokens) of streams seen to end, told with the next submission
        self.ended: list[tuple[str, int]] = []
        # usage records of requests that ended here: with the next submission, or on their
        # own within USAGE_FLUSH_S (the controller writes the log)
        self.usage: list[Any] = []
        self._usage_due: asyncio.TimerHandle | None = None
        self.kick = asyncio.Event()
        self.hurry = False  # a request of a class above 0 is in the outbox: no linger
        self.subscribed = asyncio.Event()
        self.flusher = self.loop.create_task(self._flush_loop())
        self.reader = self.loop.create_task(self._read_loop())

    @property
    def subscriber(self) -> str:
        return f"{self.base_id}.{self.generation}"

    async def admit(self, meta: RequestMeta, timeout_s: float, ack_timeout_s: float):
        """The request's Assignment. Raises AdmissionTimeout when the controller has not
        acknowledged it within `ack_timeout_s` (counted again after each restart), or when
        `timeout_s` passes in all."""
        loop = self.loop
        p = _Pending(meta, loop.create_future(), loop.time())
        self.pending[meta.request_id] = p
        self.outbox.append(meta)
        if meta.priority > 0:
            self.hurry = True
        self.kick.set()
        deadline = loop.time() + timeout_s
        try:
            while True:
                now = loop.time()
                if now >= deadline:
                    raise AdmissionTimeout(f"not placed within {timeout_s:g}s")
                if not p.acked and now >= p.since + ack_timeout_s:
                    raise AdmissionTimeout(
                        f"the fairness controller did not take the request within "
                        f"{ack_timeout_s:g}s (it may be restarting)"
                    )
                wait = deadline - now if p.acked else min(deadline, p.since + ack_timeout_s) - now
                try:
                    return await asyncio.wait_for(asyncio.shield(p.fut), wait)
                except asyncio.TimeoutError:
                    continue  # (acknowledged meanwhile, or a restart began its wait again)
        finally:
            self.pending.pop(meta.request_id, None)

    def end(self, request_id: str, num_out: int) -> None:
        """The request's stream ended with `num_out` output tokens: the controller hears it
        with the next submission (its replica's report tells it anyway; this is sooner where
        the next request follows)."""
        if len(self.ended) >= 8 * self.max_batch:  # nobody submits: the reports will do
            del self.ended[: self.max_batch]
        self.ended.append((request_id, num_out))

    def record(self, records: list[Any]) -> None:
        """Usage records for the controller's log: sent within USAGE_FLUSH_S, kept (and sent
        again) while the controller is restarting."""
        self.usage.extend(records)
        if self._usage_due is None:
            self._usage_due = self.loop.call_later(USAGE_FLUSH_S, self._usage_flush)

    def _usage_flush(self) -> None:
        self._usage_due = None
        if self.usage:
            self.kick.set()

    async def _flush_loop(self) -> None:
        delay = 0.05
        while True:
            await self.kick.wait()
            if not self.hurry:
                await asyncio.sleep(self.linger_s)  # let a burst gather into one call
            await self.subscribed.wait()  # assignments need a stream to come back on
            self.kick.clear()
            self.hurry = False
            batch, self.outbox = self.outbox[: self.max_batch], self.outbox[self.max_batch :]
            if self.outbox:
                self.kick.set()
            batch = [m for m in batch if m.request_id in self.pending]  # not timed out
            if not batch and not self.usage:
                continue
            ended, self.ended = self.ended, []
            usage, self.usage = self.usage, []
            try:
                if trace.ON:
                    for m in batch:
                        trace.mark(m.request_id, "submit_sent")
                generation = self.generation
                args = (self.subscriber, batch, ended) + ((usage,) if usage else ())
                ref = self.controller().submit_many.remote(*args)
                held = await asyncio.wait_for(ref, timeout=30.0)
                for rid in held if generation == self.generation else ():  # (not a dead one's)
                    p = self.pending.get(rid)
                    if p is not None:
                        p.acked = True
                delay = 0.05
            except asyncio.CancelledError:
                raise
            except Exception as e:  # restarting: try again shortly
                log.info("submit_many failed (%r); retrying", e)
                self.outbox[:0] = batch
                self.ended[:0] = ended
                self.usage[:0] = usage
                self.kick.set()
                await asyncio.sleep(delay)
                delay = min(1.0, delay * 2)

    async def _read_loop(self) -> None:
        delay = 0.05
        previous = None  # the id of the stream that broke (the controller lets it go)
        while True:
            gen = (
                self.controller()
                .assignments.options(num_returns="streaming")
                .remote(self.subscriber, self.owner, previous)
            )
            self.subscribed.set()
            handles: dict[str, Any] = {}  # replica id -> handle, as this stream sent them
            try:
                async for ref in gen:
                    delay = 0.05
                    sent, batch = await ref
                    handles.update(sent)
                    for a in batch:
                        p = self.pending.get(a.request_id)
                        if p is not None and not p.fut.done():
                            if a.replica is None:  # the stream sent its handle once, before
                                a.replica = handles.get(a.replica_id)
                            p.fut.set_result(a)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.info("assignment stream broke (%r); re-subscribing", e)
            # A new subscriber id, so a stale stream can never take our items; then resubmit
            # what is still waiting (already placed ones get their assignment re-sent). What
            # the old controller acknowledged, the restarted one may not hold.
            self.subscribed.clear()
            previous = self.subscriber
            self.generation += 1
            now = self.loop.time()
            for p in self.pending.values():
                if p.acked:  # (one never taken keeps its first deadline: retries don't extend it)
                    p.acked, p.since = False, now
            await asyncio.sleep(delay)
            delay = min(1.0, delay * 2)
            queued = {m.request_id for m in self.outbox}
            self.outbox.extend(p.meta for rid, p in self.pending.items() if rid not in queued)
            self.kick.set()
