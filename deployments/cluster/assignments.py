"""The controller's side towards its clients (`Controller` inherits it): batched submissions
(`submit_many`), one long-lived `assignments` stream per client process carrying where each
request runs, cancellations, and the clients' processes that die.

One call submits many requests and one stream carries their assignments back: per-request
actor calls would cost every client and the controller a call per request; batches amortize
that. Idempotent per request id, so a client resubmits whatever is pending after a controller
restart.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

import ray

from fairbatch.deployments.cluster import channel, trace
from fairbatch.deployments.cluster.wire import Assignment, RequestMeta

log = logging.getLogger(__name__)

_END = object()  # put in a subscriber's outbox: its assignment stream ends
MAX_SUCCESSORS = 4096  # re-subscriptions remembered (a few per client process and restart)


class ClientSide:
    """Needs from the controller: `core` (FairnessCore), `handles`, `usage` (its
    UsageLedger or None), `_apply`, `_spawn`, `_background`."""

    core: Any
    handles: dict[str, Any]
    usage: Any

    def _init_clients(self) -> None:
        # subscriber id -> its assignments not yet streamed out
        self._outboxes: dict[str, asyncio.Queue] = {}
        self._owner: dict[str, str] = {}  # request id -> subscriber waiting for it
        # subscriber -> its process (ActorOwner, or a driver's DriverOwner), checked every
        # `subscriber_check_s`; consumer id -> the same owner, sent with forwarded requests
        # once per (replica, consumer) so the replica can watch a consumer it has not heard from
        self._subscriber_owner: dict[str, Any] = {}
        self._consumer_owner: dict[str, Any] = {}
        self._owner_sent: set[tuple[str, str]] = set()
        self._last_subscriber_check = 0.0
        self._checking_subscribers = False
        # subscriber id -> the id its client re-subscribed under (its stream broke): a
        # submission sent under the old id that arrives late (Ray retries a call across a
        # restart) is answered on the new stream, not on one nobody reads
        self._successor: dict[str, str] = {}

    async def submit_many(
        self,
        subscriber: str,
        metas: list[RequestMeta],
        ended: list[tuple[str, int]] = (),
        usage: list[tuple[str, str]] = (),
    ) -> list[str]:
        """Queue (or place) `metas` for `subscriber`'s stream. Returns their ids: the
        client's acknowledgement that this controller holds them (queued or placed).
        `ended`: (request id, output tokens) of the streams the client has seen end since its
        last call; `usage`: (request id, usage record as a JSON line) of requests that ended
        there."""
        self._background()
        if ended:
            self.core.client_ended(ended)
        ledger = self.usage
        if usage and ledger is not None:
            ledger.record(usage)
        while subscriber in self._successor:
            subscriber = self._successor[subscriber]
        outbox = self._outbox(subscriber)
        owner = self._subscriber_owner.get(subscriber)
        for meta in metas:
            rid = meta.request_id
            if trace.ON:
                trace.begin(rid, meta.tenant, "controller")
            if owner is not None:
                self._consumer_owner.setdefault(meta.consumer, owner)
            where = self.core.where(rid)
            if where is not None and where in self.handles:
                outbox.put_nowait(self._placed(rid, where))
                continue
            self._owner[rid] = subscriber
            if rid not in self.core.tickets:
                self._apply(self.core.submit(meta))
                if ledger is not None and rid in self.core.tickets:
                    ledger.submitted(meta)
        return [m.request_id for m in metas]

    @ray.method(max_task_retries=0)  # a retried stream would skip items: re-subscribe instead
    async def assignments(self, subscriber: str, owner: Any = None, replaces: str | None = None):
        """Stream `(handles, batch)` for requests this subscriber submitted: `batch` a list of
        Assignments, `handles` {replica id: actor handle} for the replicas this stream has not
        sent before. Each handle goes once per stream, not once per request (deserializing one
        per request cost the ingress ~4% of its CPU): an Assignment here carries `replica` None
        when its handle went in this or an earlier message. (A replica id never names another
        actor: a replacement gets an id of its own, `replica_set.SEP`.) `owner`: the
        subscriber's process, `ActorOwner` or a driver's `DriverOwner` (None: not known);
        once it is dead, its queued requests are cancelled and this stream ends
        (`_check_subscribers`). `replaces`: the id this client subscribed under before (its
        stream broke): that stream ends, and the assignments still due to it come on this one."""
        self._background()
        if owner is not None:
            self._subscriber_owner[subscriber] = owner
        if replaces is not None and replaces != subscriber:
            self._forget_subscriber(replaces, successor=subscriber)
        outbox = self._outbox(subscriber)
        sent: set[str] = set()  # the replica ids whose handle this stream sent
        while True:
            first = await outbox.get()
            if first is _END:
                return
            batch = [first]
            while not outbox.empty():
                item = outbox.get_nowait()
                if item is _END:
                    outbox.put_nowait(_END)  # (after this batch)
                    break
                batch.append(item)
            handles: dict[str, Any] = {}
            for i, a in enumerate(batch):
                if a.replica is None:  # expired, or no handle known: as it is
                    continue
                if a.replica_id not in sent:
                    sent.add(a.replica_id)
                    handles[a.replica_id] = a.replica
                batch[i] = dataclasses.replace(a, replica=None)
            yield handles, batch

    def _outbox(self, subscriber: str) -> asyncio.Queue:
        outbox = self._outboxes.get(subscriber)
        if outbox is None:
            outbox = self._outboxes[subscriber] = asyncio.Queue()
        return outbox

    def _placed(self, rid: str, where: str) -> Assignment:
        """The assignment of a request already placed, sent again (a retried admission)."""
        return Assignment(rid, where, self.handles[where])

    async def cancel(self, request_id: str) -> None:
        t = self.core.tickets.get(request_id)
        if t is not None and t.replica in self.handles and t.meta:
            # Forwarded: the replica may hold it before its client heard where it runs
            self.handles[t.replica].abort.remote(request_id)
        self._owner.pop(request_id, None)
        self.core.cancel(request_id)
        self._apply(self.core.dispatch())

    # ---- subscribers that die ----------------------------------------------------------------

    subscriber_check_s = 2.0  # how often the subscribers' processes are pinged

    def _check_subscribers_due(self) -> None:
        now = time.monotonic()
        if not self._subscriber_owner or self._checking_subscribers:
            return  # (a ping can take 10 s: one round at a time)
        if now - self._last_subscriber_check >= self.subscriber_check_s:
            self._last_subscriber_check = now
            self._checking_subscribers = True
            self._spawn(self._check_subscribers())

    async def _check_subscribers(self) -> None:
        """A subscriber whose process died can never take its assignments: its requests still
        queued here are cancelled (they would otherwise be placed, and run unread to their last
        token), its stream ends, and what is kept for it goes."""
        try:
            subs = list(self._subscriber_owner.items())
            verdicts = await asyncio.gather(*(channel.owner_is_dead(h, 10.0) for _, h in subs))
            for (sub, owner), dead in zip(subs, verdicts):
                if dead and self._subscriber_owner.get(sub) is owner:
                    await self._drop_subscriber(sub, owner)
        finally:
            self._checking_subscribers = False

    async def _drop_subscriber(self, subscriber: str, owner: Any) -> None:
        queued = [rid for rid, sub in self._owner.items() if sub == subscriber]
        if queued:
            log.info("subscriber %s died: cancelling its %d queued request(s)", subscriber,
                     len(queued))  # fmt: skip
        for rid in queued:
            await self.cancel(rid)
        self._forget_subscriber(subscriber)
        gone = {c for c, h in self._consumer_owner.items() if h == owner}
        for consumer in gone:
            del self._consumer_owner[consumer]
        self._owner_sent = {k for k in self._owner_sent if k[1] not in gone}

    def _forget_subscriber(self, subscriber: str, successor: str | None = None) -> None:
        """End its stream and keep nothing for it; what it still waits for goes to
        `successor` (the same client under a new id), if any."""
        self._subscriber_owner.pop(subscriber, None)
        if successor is not None:
            self._successor[subscriber] = successor
            if len(self._successor) > MAX_SUCCESSORS:  # the oldest are long answered
                del self._successor[next(iter(self._successor))]
            for rid, sub in self._owner.items():
                if sub == subscriber:
                    self._owner[rid] = successor
        outbox = self._outboxes.pop(subscriber, None)
        if outbox is not None:
            outbox.put_nowait(_END)  # its stream ends (were its caller still reading)
