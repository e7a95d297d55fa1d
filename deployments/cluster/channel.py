"""The serving plane between a replica and one consumer process (an ingress replica, a handle
caller, a driver): one long-lived channel per (replica, consumer), one message per engine step.

Replica side, `Outbox`: every step's deltas of one consumer's requests are appended to its
outbox; the consumer's `Replica.channel` stream takes everything there at once, so a message
carries one step's deltas of all of that consumer's requests (more when the consumer reads
slower than the engine steps: batches grow, messages do not). The outbox is bounded: past
`limit` unread items the consumer is too slow, and its requests are aborted with an error
rather than grow the replica's memory.

The channel is a TCP socket of its own by default (`socket_channel.py`: about half the
ingress's CPU per token that a Ray stream costs); a Ray streaming generator (`Replica.channel`)
where `transport` is "ray", or where the socket cannot be reached (a firewall between nodes).

Consumer side, `ReplicaLink`: reads the channel and fans each item out to its request's queue;
when the controller does not submit this process's requests for it, submits them in batches
(one actor call per event-loop turn, not per request). A broken channel (the replica died)
puts `LinkLost` into every queue, so each request resubmits elsewhere. A request the controller
submitted for this process (see `RequestMeta.consumer`) can send items before the process has
heard where it runs: items of an `expected` request with no queue yet wait for its `open`.

Before this, every token crossed Ray as a streaming item of its own per request: on a 2-core
machine the two hops cost about as much CPU as the model's forward pass.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError

from fairbatch.deployments.cluster import trace
from fairbatch.deployments.cluster.socket_channel import CONNECT_TIMEOUT_S, connect, read_messages
from fairbatch.deployments.cluster.wire import RequestMeta

log = logging.getLogger(__name__)

# Messages a channel may have in flight that the consumer has not read (Ray's generator
# backpressure): past that the replica's stream waits, and deltas gather in the outbox.
CHANNEL_BACKPRESSURE = 8
TRANSPORTS = ("socket", "ray")


def check_transport(transport: str) -> str:
    if transport not in TRANSPORTS:
        raise ValueError(f"channel transport {transport!r}: expected one of {TRANSPORTS}")
    return transport


@dataclass(frozen=True)
class ActorOwner:
    """The owner of a consumer that runs in an actor (an ingress replica, a handle caller's
    actor): the actor's id, which the GCS's actor table checks. Not the actor's handle: a
    process deserializes a handle by importing the actor's class, and for a Ray Serve replica
    that imports Ray Serve (~0.6 s on this machine), on the event loop of the replica or
    controller that received it - the first requests of every new ingress waited that long."""

    actor_id: str  # hex


@dataclass(frozen=True)
class DriverOwner:
    """The owner of a consumer that runs in a Ray driver, which has no actor to ping: its
    job. The GCS marks a driver's job dead as soon as the driver's process is gone."""

    job_id: str  # hex


def own_process() -> ActorOwner | DriverOwner | None:
    """The process the caller runs in: its actor, or its driver's job; None in a task (no
    process of its own to check)."""
    ctx = ray.get_runtime_context()
    actor_id = ctx.get_actor_id()
    if actor_id is not None:
        return ActorOwner(actor_id)
    if ctx.worker.mode == ray.SCRIPT_MODE:
        return DriverOwner(ctx.get_job_id())
    return None


@dataclass
class Outbox:
    """One consumer's unread items on a replica (`StreamItem`s and `Moved` markers)."""

    consumer: str
    owner: Any = None  # the consumer's ActorOwner or DriverOwner, checked for liveness
    limit: int = 65536  # unread items past which the consumer counts as stalled
    items: list = field(default_factory=list)
    requests: set[str] = field(default_factory=set)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    generation: int = 0  # bumped by each channel opened; an older one then ends
    stalled: bool = False  # over the limit: its requests are being aborted

    def put(self, item: Any) -> bool:
        """Queue an item; False when the outbox is over its limit (nothing queued)."""
        if self.stalled:
            return False
        if len(self.items) >= self.limit:
            self.stalled = True
            return False
        self.items.append(item)
        self.ready.set()
        return True

    def take(self) -> list:
        items, self.items = self.items, []
        self.ready.clear()
        return items


class LinkLost(Exception):
    """The channel to a replica broke (the replica died or became unreachable)."""


class RequestRefused(ValueError):
    """The replica refused the request itself (a duplicate id, a prompt over its limits)."""


class ReplicaLink:
    """This process's end of one replica's channel (one per replica per event loop)."""

    def __init__(
        self,
        replica_id: str,
        handle: Any,
        consumer: str,
        owner: Any,
        expected: set[str] | frozenset = frozenset(),
        transport: str = "socket",
    ) -> None:
        self.replica_id = replica_id
        self.transport = check_transport(transport)
        self.handle = handle
        self.consumer = consumer
        self.owner = owner  # this process's ActorOwner or DriverOwner (None: not known)
        self.queues: dict[str, asyncio.Queue] = {}
        self.expected = expected  # ids of requests admitted for this process, not yet opened
        self.early: dict[str, list] = {}  # their items so far
        self.error: BaseException | None = None
        self.loop = asyncio.get_running_loop()
        self._outgoing: list[tuple[RequestMeta, asyncio.Future]] = []
        self._tasks: set[asyncio.Task] = set()
        self.reader = self.loop.create_task(self._read())

    @property
    def alive(self) -> bool:
        return self.error is None and not self.reader.done()

    def open(self, request_id: str) -> asyncio.Queue:
        """The queue the request's items will arrive on (open it before submitting)."""
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = queue
        for item in self.early.pop(request_id, ()):
            queue.put_nowait(item)
        if self.error is not None:
            queue.put_nowait(LinkLost(repr(self.error)))
        return queue

    def close(self, request_id: str) -> None:
        self.queues.pop(request_id, None)
        self.early.pop(request_id, None)

    async def submit(self, meta: RequestMeta) -> None:
        """Start the request on the replica (batched with others of this loop turn). Raises
        RequestRefused for a bad request, LinkLost when the replica cannot be reached."""
        fut = self.loop.create_future()
        if not self._outgoing:
            self.loop.call_soon(self._flush)
        self._outgoing.append((meta, fut))
        await fut

    async def adopt(self, migrated: Any) -> None:
        """Resume a request that migrated here (`migrated`: the ObjectRef from its Moved)."""
        try:
            error = await self.handle.adopt.remote(self.consumer, migrated, self.owner)
        except RayActorError as e:
            raise LinkLost(repr(e)) from e
        if error:
            raise RequestRefused(error)

    def _flush(self) -> None:
        batch, self._outgoing = self._outgoing, []
        task = self.loop.create_task(self._send(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, batch: list[tuple[RequestMeta, asyncio.Future]]) -> None:
        try:
            errors = await self.handle.submit.remote(
                self.consumer, [m for m, _ in batch], self.owner
            )
        except Exception as e:  # the replica is gone (LinkLost), or raised (a bug: refused)
            lost = isinstance(e, RayActorError)
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(LinkLost(repr(e)) if lost else RequestRefused(repr(e)))
            return
        for (_, fut), error in zip(batch, errors):
            if fut.done():
                continue
            if error:
                fut.set_exception(RequestRefused(error))
            else:
                fut.set_result(None)

    async def _read(self) -> None:
        try:
            async for items in self._messages():
                for item in items:
                    rid = item.request_id
                    if trace.ON:
                        trace.mark(rid, "received")
                    queue = self.queues.get(rid)
                    if queue is not None:
                        queue.put_nowait(item)
                    elif rid in self.expected:
                        self.early.setdefault(rid, []).append(item)
            raise LinkLost("the replica closed the channel")
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.info("channel from %s broke: %r", self.replica_id, e)
            self.error = e
            for queue in self.queues.values():
                queue.put_nowait(LinkLost(repr(e)))

    async def _messages(self):
        """The channel's messages: over the replica's socket, or over Ray."""
        if self.transport == "socket":
            offer = await self.handle.channel_socket.remote(self.consumer, self.owner)
            try:
                reader, writer = await connect(offer, CONNECT_TIMEOUT_S)
            except (OSError, asyncio.TimeoutError) as e:
                log.warning(
                    "channel socket of replica %s at %s:%d unreachable (%r): reading its channel "
                    "over Ray instead", self.replica_id, offer.host, offer.port, e,
                )  # fmt: skip
            else:
                async for items in read_messages(reader, writer):
                    yield items
                return
        async for ref in self.handle.channel.remote(self.consumer, self.owner):
            yield await ref

    def shutdown(self) -> None:
        self.reader.cancel()
        for task in self._tasks:
            task.cancel()
