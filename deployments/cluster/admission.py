"""A client process's admissions, batched: one `submit_many` call per burst of requests, one
long-lived `assignments` stream per process and event loop carrying the controller's answers.
Per-request actor calls would cost each client and the controller an actor call per request;
batches amortize that."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from typing import Any

from fairbatch.deployments.cluster import trace
from fairbatch.deployments.cluster.wire import RequestMeta

log = logging.getLogger(__name__)


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
        self.pending: dict[str, tuple[RequestMeta, asyncio.Future]] = {}
        self.outbox: list[RequestMeta] = []
        self.kick = asyncio.Event()
        self.hurry = False  # a request of a class above 0 is in the outbox: no linger
        self.subscribed = asyncio.Event()
        self.flusher = self.loop.create_task(self._flush_loop())
        self.reader = self.loop.create_task(self._read_loop())

    @property
    def subscriber(self) -> str:
        return f"{self.base_id}.{self.generation}"

    async def admit(self, meta: RequestMeta, timeout_s: float):
        fut = self.loop.create_future()
        self.pending[meta.request_id] = (meta, fut)
        self.outbox.append(meta)
        if meta.priority > 0:
            self.hurry = True
        self.kick.set()
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        finally:
            self.pending.pop(meta.request_id, None)

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
            if not batch:
                continue
            try:
                if trace.ON:
                    for m in batch:
                        trace.mark(m.request_id, "submit_sent")
                ref = self.controller().submit_many.remote(self.subscriber, batch)
                await asyncio.wait_for(ref, timeout=30.0)
                delay = 0.05
            except asyncio.CancelledError:
                raise
            except Exception as e:  # restarting: try again shortly
                log.info("submit_many failed (%r); retrying", e)
                self.outbox[:0] = batch
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
                        entry = self.pending.get(a.request_id)
                        if entry is not None and not entry[1].done():
                            if a.replica is None:  # the stream sent its handle once, before
                                a.replica = handles.get(a.replica_id)
                            entry[1].set_result(a)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.info("assignment stream broke (%r); re-subscribing", e)
            # A new subscriber id, so a stale stream can never take our items; then resubmit
            # what is still waiting (already placed ones get their assignment re-sent).
            self.subscribed.clear()
            previous = self.subscriber
            self.generation += 1
            await asyncio.sleep(delay)
            delay = min(1.0, delay * 2)
            queued = {m.request_id for m in self.outbox}
            self.outbox.extend(m for rid, (m, _) in self.pending.items() if rid not in queued)
            self.kick.set()
