"""The serving plane between a replica and one consumer process (an ingress replica, a handle
caller, a driver): one long-lived channel per (replica, consumer), one message per engine step.

Replica side, `Outbox`: every step's deltas of one consumer's requests are appended to its
outbox; the consumer's `Replica.channel` stream (a Ray streaming generator) takes everything
there at once, so a message carries one step's deltas of all of that consumer's requests (more
when the consumer reads slower than the engine steps: batches grow, messages do not). The
outbox is bounded: past `limit` unread items the consumer is too slow, and its requests are
aborted with an error rather than grow the replica's memory.

Consumer side, `ReplicaLink`: reads the channel and fans each item out to its request's queue.
The controller submits the requests to the replica for their consumer (`RequestMeta.consumer`),
so items can arrive before the consumer has heard where its request runs: items of an
`expected` request with no queue yet wait for its `open`. A broken channel (the replica died)
puts `LinkLost` into every queue, so each request resubmits elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError

from fairbatch.deployments.cluster import trace

log = logging.getLogger(__name__)

# Messages a channel may have in flight that the consumer has not read (Ray's generator
# backpressure): past that the replica's stream waits, and deltas gather in the outbox.
CHANNEL_BACKPRESSURE = 8


@dataclass(frozen=True)
class ActorOwner:
    """The owner of a consumer that runs in an actor (an ingress replica, a handle caller's
    actor): the actor's id, which the GCS's actor table checks. Not the actor's handle: a
    process deserializes a handle by importing the actor's class, and for a Ray Serve replica
    that imports Ray Serve (most of a second), on the event loop of the replica or
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


async def owner_is_dead(owner: ActorOwner | DriverOwner, timeout_s: float) -> bool:
    """True only when the GCS says the consumer's process is gone: its actor is DEAD (or no
    longer listed: the GCS forgets dead actors past a count), or a driver's job is marked
    dead. No answer in time, or any error, proves nothing: False."""
    from ray.core.generated.gcs_pb2 import ActorTableData

    try:
        gcs = ray._private.worker.global_worker.gcs_client  # (these tables have no public API)
        if isinstance(owner, ActorOwner):
            actors = await asyncio.wait_for(
                gcs.async_get_all_actor_info(
                    actor_id=ray.ActorID.from_hex(owner.actor_id), timeout=timeout_s
                ),
                timeout_s,
            )
            return all(actor.state == ActorTableData.DEAD for actor in actors.values())
        jobs = await asyncio.wait_for(
            gcs.async_get_all_job_info(
                job_or_submission_id=owner.job_id,
                skip_submission_job_info_field=True,
                skip_is_running_tasks_field=True,
                timeout=timeout_s,
            ),
            timeout_s,
        )
    except Exception:
        return False
    return any(job.is_dead for job_id, job in jobs.items() if job_id.hex() == owner.job_id)


def owner_key(owner: ActorOwner | DriverOwner) -> str:
    """An owner's id, for stats: the actor's id, or "job:<id>" for a driver."""
    if isinstance(owner, DriverOwner):
        return f"job:{owner.job_id}"
    return owner.actor_id


@dataclass
class Outbox:
    """One consumer's unread items on a replica (`RequestDelta`s and `Moved` markers)."""

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
    ) -> None:
        self.replica_id = replica_id
        self.handle = handle
        self.consumer = consumer
        self.owner = owner  # this process's ActorOwner or DriverOwner (None: not known)
        self.queues: dict[str, asyncio.Queue] = {}
        self.expected = expected  # ids of requests admitted for this process, not yet opened
        self.early: dict[str, list] = {}  # their items so far
        self.error: BaseException | None = None
        self.loop = asyncio.get_running_loop()
        self.reader = self.loop.create_task(self._read())

    @property
    def alive(self) -> bool:
        return self.error is None and not self.reader.done()

    def open(self, request_id: str) -> asyncio.Queue:
        """The queue the request's items arrive on (items that came before wait in it)."""
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

    async def adopt(self, migrated: Any) -> None:
        """Resume a request that migrated here (`migrated`: the ObjectRef from its Moved)."""
        try:
            error = await self.handle.adopt.remote(self.consumer, migrated, self.owner)
        except RayActorError as e:
            raise LinkLost(repr(e)) from e
        if error:
            raise RequestRefused(error)

    async def _read(self) -> None:
        try:
            async for ref in self.handle.channel.remote(self.consumer, self.owner):
                for item in await ref:
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

    def shutdown(self) -> None:
        self.reader.cancel()
