"""The client side of the cluster, used by the ingress and by Python callers.

`ClusterClient.generate(...)` asks the controller for a turn (`admission.AdmissionBatcher`:
batched, over Ray); when the controller assigns the request it also submits it to the replica
for this client, and the client reads its items from this process's one channel to that
replica (`channel.ReplicaLink`: one message per engine step for all of this process's requests
there). (A controller that restarts after forwarding a request, before its client
heard where, may place it again elsewhere: the client reads it where it heard, and the first
copy runs to its end unread - work lost, never a wrong or repeated token.)
It follows the request wherever it goes:
  * a `Moved` item (migration): adopt it on the destination replica, read it from that channel;
  * the replica dies mid-stream: tell the controller, and resubmit prompt + the tokens already
    delivered (same request id, same params) so the caller sees no gap and no repeat;
    the first item's `prompt_logprobs` and `num_cached_tokens` reach the caller once (the
    resubmission does not ask for prompt logprobs again once the caller has them);
  * the controller is restarting: the batcher re-subscribes and submits again what is still
    pending (idempotent per request id); a request no controller has taken within
    `admission_timeout_s` ends with an error (the API's 503 + Retry-After), one queued there
    within `admit_timeout_s` in all.
Every channel names its process as its owner (the actor it runs in, or a driver's job), so the
controller can cancel what a client process that died still had queued and a replica can abort
what it had running (Ray does not stop either stream when its reader dies).
Every stream ends with a finished item: tokens, or finish_reason "error". Nothing waits forever.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

from fairbatch.deployments.cluster import trace
from fairbatch.deployments.cluster.admission import AdmissionBatcher
from fairbatch.deployments.cluster.channel import (
    ActorOwner,
    DriverOwner,
    LinkLost,
    ReplicaLink,
    RequestRefused,
    own_process,
)
from fairbatch.deployments.cluster.wire import (
    FIRST_ONLY,
    Assignment,
    Moved,
    RequestMeta,
)
from fairbatch.engine.outputs import RequestDelta
from fairbatch.engine.sampling_params import SamplingParams
from fairbatch.kv.block_pool import hash_block
from fairbatch.scheduler.request import lora_salt

log = logging.getLogger(__name__)

AFFINITY_BLOCKS = 8  # leading prompt blocks hashed for prefix affinity


class ClusterClient:
    def __init__(
        self,
        controller: Any,
        *,
        block_size: int = 16,
        salt_rule: Callable[[int, str], str] | None = None,
        admit_timeout_s: float = 120.0,
        item_timeout_s: float = 120.0,
        max_resubmits: int = 8,
        admission_timeout_s: float = 30.0,
    ) -> None:
        self.controller = controller  # actor handle, or its name
        self.block_size = block_size
        # the model's salt of a prompt by its length (CausalLM.cache_salt_rule), or None
        self.salt_rule = salt_rule
        self.admit_timeout_s = admit_timeout_s
        self.admission_timeout_s = admission_timeout_s
        self.item_timeout_s = item_timeout_s
        self.max_resubmits = max_resubmits
        # requests admitted here and not ended: the controller submits each to its replica
        # for this client, whose items may come before the client heard where it runs
        self._expected: set[str] = set()
        self._batcher: AdmissionBatcher | None = None
        self._where: dict[str, Any] = {}  # request id -> the replica holding it now (streams)
        self._links: dict[str, ReplicaLink] = {}  # replica id -> this loop's channel to it
        self._links_loop: asyncio.AbstractEventLoop | None = None
        self._consumer_base = uuid.uuid4().hex
        self._consumer_gen = 0
        self._owner: ActorOwner | DriverOwner | None = None  # this process, see owner()
        self._owner_known = False

    def _controller(self) -> Any:
        if isinstance(self.controller, str):
            self.controller = ray.get_actor(self.controller)
        return self.controller

    def owner(self) -> ActorOwner | DriverOwner | None:
        """The process this client runs in (`channel.own_process`), looked up once."""
        if not self._owner_known:
            self._owner = own_process()
            self._owner_known = True
        return self._owner

    def _consumer(self) -> str:
        """This event loop's consumer id: the name of its channels on every replica."""
        loop = asyncio.get_running_loop()
        if self._links_loop is not loop:  # links (their tasks) belong to one event loop
            self._links = {}
            self._links_loop = loop
            self._consumer_gen += 1
        return f"{self._consumer_base}.{self._consumer_gen}"

    def _link(self, replica_id: str, handle: Any) -> ReplicaLink:
        """This event loop's channel to the replica (a new one after the old one broke)."""
        consumer = self._consumer()
        link = self._links.get(replica_id)
        if link is None or not link.alive or link.handle != handle:
            if link is not None:
                link.shutdown()
            link = ReplicaLink(replica_id, handle, consumer, self.owner(), self._expected)
            self._links[replica_id] = link
        return link

    def salt_of(self, prompt_ids: list[int], salt: str, lora: Any) -> str:
        """The prefix-cache salt the replica's engine gives this request: its adapter's, and
        its model's for a prompt that long."""
        salt = lora_salt(salt, None if lora is None else lora.name)
        return salt if self.salt_rule is None else self.salt_rule(len(prompt_ids), salt)

    def prefix_hashes(self, prompt_ids: list[int], salt: str) -> list[bytes]:
        bs = self.block_size
        hashes: list[bytes] = []
        parent = None
        for i in range(min(len(prompt_ids) // bs, AFFINITY_BLOCKS)):
            parent = hash_block(parent, prompt_ids[i * bs : (i + 1) * bs], salt)
            hashes.append(parent)
        return hashes

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams | None = None,
        *,
        tenant: str = "default",
        priority: int = 0,
        request_id: str | None = None,
        cache_salt: str | None = None,
        fork_of: str | None = None,
        on_assign: Callable[[Assignment], Any] | None = None,
    ) -> AsyncIterator[RequestDelta]:
        """Stream the request's items. `on_assign` is called with each assignment the
        controller makes for it (once, plus once per resubmission)."""
        params = params or SamplingParams()
        lora = params.lora
        salt = self.salt_of(prompt_ids, cache_salt or tenant, lora)
        meta = RequestMeta(
            request_id or uuid.uuid4().hex,
            list(prompt_ids),
            params,
            tenant=tenant,
            priority=priority,
            cache_salt=cache_salt,
            prefix_hashes=self.prefix_hashes(list(prompt_ids), salt),
            fork_of=fork_of,
            consumer=self._consumer(),
        )
        meta.set_deadlines(time.time())  # absolute: resubmissions keep them
        delivered: list[int] = []
        sent: set[str] = set()  # the FIRST_ONLY fields the caller has had
        resubmits = 0
        moves = 0  # replicas it left: migrations, drains, resubmissions after a death
        finished = False
        replica_id, handle = "", None
        rid = meta.request_id
        if trace.ON:
            trace.begin(rid, tenant, "client")
        self._expected.add(rid)
        try:
            while True:
                try:
                    assignment = await self._admit(meta)
                except Exception as e:
                    log.warning("admit %s failed: %r", rid, e)
                    await self._abandon(rid, None)
                    finished = True
                    yield RequestDelta(rid, [], "", True, "error", error=f"admission failed: {e!r}")
                    return
                if assignment.refused is not None:  # over a cluster-wide limit
                    finished = True
                    raise assignment.refused
                if assignment.finish_reason is not None:  # its queue deadline passed
                    finished = True
                    yield RequestDelta(rid, [], "", True, assignment.finish_reason)
                    return
                replica_id, handle = assignment.replica_id, assignment.replica
                self._where[rid] = handle
                if on_assign is not None:
                    on_assign(assignment)
                link = self._link(replica_id, handle)
                queue = link.open(rid)
                try:
                    while True:
                        if queue.empty():  # (a timeout costs a task: only when waiting)
                            item = await _get(queue, self.item_timeout_s)
                        else:
                            item = queue.get_nowait()
                        if isinstance(item, LinkLost):
                            raise item
                        if isinstance(item, Moved) and item.replica is None:
                            _resubmission(meta, delivered, sent)  # requeued by a drain
                            moves += 1
                            break
                        if isinstance(item, Moved):
                            moves += 1
                            link.close(rid)
                            replica_id, handle = item.replica_id, item.replica
                            self._where[rid] = handle
                            link = self._link(replica_id, handle)
                            queue = link.open(rid)
                            await link.adopt(item.migrated)
                            continue
                        delivered.extend(item.token_ids)
                        _pass_once(item, sent)
                        if item.finished:
                            finished = True
                            item.num_moves = moves
                        if trace.ON:
                            trace.mark(rid, "yielded")
                        yield item
                        if finished:
                            return
                except (LinkLost, ActorDiedError, RayActorError, ActorUnavailableError) as e:
                    resubmits += 1
                    log.info("replica %s lost %s: %r", replica_id, rid, e)
                    if handle is not None:  # in case it lives on: it must not run twice
                        self._abort_quietly(rid, handle)
                    if resubmits > self.max_resubmits:
                        finished = True
                        yield RequestDelta(rid, [], "", True, "error", error=f"gave up: {e!r}")
                        return
                    await self._report_failure(replica_id)
                    _resubmission(meta, delivered, sent)
                    moves += 1
                except (RequestRefused, RayTaskError, asyncio.TimeoutError) as e:
                    # a bad request, or a stall
                    await self._abandon(rid, handle)
                    finished = True
                    yield RequestDelta(
                        rid, [], "", True, "error", replica_id=replica_id, error=repr(e)
                    )
                    return
                finally:
                    link.close(rid)
        finally:
            self._where.pop(rid, None)
            self._expected.discard(rid)
            for link in self._links.values():
                link.early.pop(rid, None)
            if not finished:  # the caller went away: free the request wherever it is
                await self._abandon(rid, handle)
            elif self._batcher is not None:
                self._batcher.end(rid, len(delivered))

    async def abort(self, request_id: str, timeout_s: float = 15.0) -> bool:
        """Cancel a request this client is streaming: the controller drops it (queued or
        assigned) and the replica holding it now (migrations followed) aborts it, so its stream
        ends with an "abort" item. True if that replica still had it. Both calls are sent
        before the first await, so a caller cancelled here cannot stop them."""
        handle = self._where.get(request_id)
        try:
            self._controller().cancel.remote(request_id)
        except Exception as e:  # the controller is restarting: the replica abort still counts
            log.info("cancel(%s) not sent: %r", request_id, e)
        if handle is None:
            return False
        try:
            ref = handle.abort.remote(request_id)
            return bool(await asyncio.wait_for(ref, timeout=timeout_s))
        except Exception as e:  # the replica died or stalled: nothing left to free there
            log.info("abort(%s) on the replica failed: %r", request_id, e)
            return False

    @staticmethod
    def _abort_quietly(request_id: str, handle: Any) -> None:
        try:
            handle.abort.remote(request_id)
        except Exception:  # it is gone
            pass

    def record_usage(self, records: list[Any]) -> None:
        """(request id, JSON line) usage records for the cluster's log, sent with this
        process's submissions."""
        self._admissions().record(records)

    def _admissions(self) -> AdmissionBatcher:
        """This event loop's batcher."""
        loop = asyncio.get_running_loop()
        if self._batcher is None or self._batcher.loop is not loop:
            self._batcher = AdmissionBatcher(self._controller, owner=self.owner())
        return self._batcher

    async def _admit(self, meta: RequestMeta):
        batcher = self._admissions()
        return await batcher.admit(meta, self.admit_timeout_s, self.admission_timeout_s)

    async def _report_failure(self, replica_id: str) -> None:
        try:
            await asyncio.wait_for(
                self._controller().replica_failed.remote(replica_id), timeout=15.0
            )
        except Exception as e:  # the resubmission goes ahead anyway
            log.info("replica_failed(%s) not delivered: %r", replica_id, e)

    async def _abandon(self, request_id: str, handle: Any) -> None:
        try:
            self._controller().cancel.remote(request_id)
            if handle is not None:
                handle.abort.remote(request_id)
        except Exception:
            pass


def _resubmission(meta: RequestMeta, delivered: list[int], sent: set[str]) -> None:
    """`meta` submitted again: with the tokens the caller has, as a later attempt (its tenant
    is not charged again), without prompt logprobs once the caller has them."""
    meta.output_ids = list(delivered)
    meta.attempt += 1
    if "prompt_logprobs" in sent:
        meta.params = dataclasses.replace(meta.params, prompt_logprobs=None)


def _pass_once(item: RequestDelta, sent: set[str]) -> None:
    """Clear the FIRST_ONLY fields of `item` that the caller already had from this request
    (the replica that takes over a resubmission may send them again); note the others."""
    for name in FIRST_ONLY:
        if getattr(item, name) is not None:
            if name in sent:
                setattr(item, name, None)
            sent.add(name)


async def _get(queue: asyncio.Queue, timeout_s: float) -> Any:
    """`queue.get()` within `timeout_s` (asyncio.TimeoutError). On Python 3.11+ with
    `asyncio.timeout`, which never swallows a cancellation; `asyncio.wait_for` there returns the
    item instead when the cancel and the item come in the same turn, and a stream cancelled
    that way would run to its end."""
    timeout = getattr(asyncio, "timeout", None)
    if timeout is None:  # Python 3.10
        return await asyncio.wait_for(queue.get(), timeout_s)
    async with timeout(timeout_s):
        return await queue.get()


async def collect(client: ClusterClient, prompt_ids: list[int], params, **kw) -> dict:
    """Run one request to the end; its tokens, the items and the replicas that served it."""
    tokens: list[int] = []
    items: list[RequestDelta] = []
    async for item in client.generate(prompt_ids, params, **kw):
        tokens.extend(item.token_ids)
        items.append(item)
    return {
        "tokens": tokens,
        "items": items,
        "finish_reason": items[-1].finish_reason if items else None,
        "replicas": list(dict.fromkeys(i.replica_id for i in items if i.replica_id)),
    }
