"""The replica actor: one per GPU, owns an EngineCore and runs its step loop continuously.

Data plane (`channel.py`): the controller submits requests in batches for their consumers (an
ingress replica, a handle caller, a driver), and each consumer reads one long-lived channel (a
Ray streaming generator); after every engine step the deltas of each consumer's requests go to
that consumer's outbox, and its channel takes them as one message. Tokens never pass through
the controller. Control plane: reports to the controller (`replica_report.py`), and the
controller's commands (preempt, migrate out, counters) run between steps on the engine thread.
What the replica runs, and its config, are in `replica_config.py`.

A consumer that dies does not always end its channel: Ray keeps running an actor's streaming
generator after the process consuming it is gone. So a consumer names its process when it
submits (its actor, or a driver's job: `ActorOwner`, `DriverOwner`), and the replica checks
that process every `owner_check_s` while it has requests here (the GCS's actor or job table);
the requests of one that is dead are aborted, which frees their KV blocks and, through the
next report, the controller's slots. One that stops reading is treated alike once its outbox
holds `unread_items_per_seat x max_num_seqs` items.

`Replica` is a plain class; `replica_actor()` wraps it for Ray with `num_gpus=1, num_cpus=0`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass, replace
from typing import Any

import ray

from fairbatch.deployments.cluster import channel, trace
from fairbatch.deployments.cluster.channel import CHANNEL_BACKPRESSURE, Outbox, owner_key
from fairbatch.deployments.cluster.replica_config import ReplicaConfig, build_core, pace_step
from fairbatch.deployments.cluster.replica_report import Reports
from fairbatch.deployments.cluster.wire import Moved, RequestMeta
from fairbatch.engine.core import MigratedRequest
from fairbatch.engine.outputs import RequestDelta
from fairbatch.scheduler import RequestStatus

__all__ = ["DEAD_CONSUMER", "Replica", "ReplicaConfig", "build_core", "replica_actor"]

log = logging.getLogger(__name__)


@dataclass
class _Route:
    box: Outbox  # the consumer its items go to
    num_out: int  # output tokens it has (reported when it leaves)


DEAD_CONSUMER = "the consumer died"  # why a submission for a consumer found dead is refused
DEAD_CONSUMERS_KEPT = 1024  # consumer ids (one per client process) remembered as dead


def _trace_step(request_id: str, step: int, times: trace.StepTimes) -> None:
    """The step that made the request's delta (the first one counts), and its arrival here."""
    for point, value in (
        ("token_step", step),
        ("step_start", times.start),
        ("step_end", times.end),
        ("step_cpu", times.cpu),
        ("step_wait", times.wait),
        ("delivered", None),
    ):
        trace.mark(request_id, point, value)


class Replica(Reports):
    def __init__(
        self,
        replica_id: str,
        config: ReplicaConfig,
        controller_name: str | None = None,
        namespace: str | None = None,
    ) -> None:
        from fairbatch.engine.async_engine import AsyncEngine

        if config.device == "auto":  # a Ray GPU may be fake: ask torch, never Ray
            import torch

            config = replace(config, device="cuda" if torch.cuda.is_available() else "cpu")
        self.replica_id = replica_id
        self.config = config
        self.time_scale = config.time_scale
        # built on the engine thread, which runs every step (why: AsyncEngine.build)
        self.engine = AsyncEngine.build(
            functools.partial(build_core, config), step_hook=self._pace, sink=self._deliver
        )
        self.core = self.engine.engine
        if trace.ON:
            self.engine.step_clock = trace.StepClock()
        self._routes: dict[str, _Route] = {}  # request id -> where its items go
        self._boxes: dict[str, Outbox] = {}  # consumer id -> its unread items
        # consumers found dead (oldest first, at most DEAD_CONSUMERS_KEPT): a submission for one
        # comes from the controller, which still had its queued requests, and is refused
        self._dead_consumers: dict[str, None] = {}
        self._stalling: set[str] = set()  # consumers whose requests are being dropped
        self._exports: list[tuple[float, Any]] = []  # (time, ObjectRef) of migrated requests
        self._meta: dict[str, tuple[str, int, int]] = {}  # id -> (tenant, priority, max_tokens)
        self.num_imported_kv_blocks = 0
        self.controller_name = controller_name
        self.namespace = namespace
        self._init_reports()
        self._owner_watch: asyncio.Task | None = None

    def _pace(self) -> None:
        pace_step(self.core, self.time_scale)  # on the engine thread, after each step

    # ---- data plane -------------------------------------------------------------------------

    async def submit(
        self, consumer: str, metas: list[RequestMeta], owner: Any = None
    ) -> list[str | None]:
        """Start new (or resubmitted) requests whose items go to `consumer`'s channel; the
        controller sends them for the consumer, which does not wait for this answer. Returns
        one entry per request: None when it was added, else why it was refused; a refusal also
        goes to the consumer as the request's last item, and a request already here for the
        consumer counts as added (the controller restarted and placed it again). `owner`: the
        consumer's process (`ActorOwner`, or a driver's `DriverOwner`), watched so its
        requests end if it dies; None when not known yet (its channel brings it)."""
        self._start_reporter()
        if consumer in self._dead_consumers:  # nobody would read its items: never run them
            return [DEAD_CONSUMER] * len(metas)
        box = self._outbox(consumer, owner)
        errors: list[str | None] = [None] * len(metas)
        batch: list[tuple[int, str, tuple, int, Any]] = []
        seen: set[str] = set()
        for i, meta in enumerate(metas):
            rid = meta.request_id
            if trace.ON:
                trace.begin(rid, meta.tenant, "replica")
            route = self._routes.get(rid)
            if route is not None and route.box is box:
                continue
            if route is not None or rid in seen:
                errors[i] = f"duplicate request id {rid!r}"
                continue
            seen.add(rid)
            if meta.output_ids:
                add = functools.partial(self.core.import_request, self._resubmitted(meta))
            else:
                add = functools.partial(
                    self.core.add_request,
                    list(meta.prompt_ids),
                    meta.params,
                    request_id=rid,
                    tenant=meta.tenant,
                    priority=meta.priority,
                    cache_salt=meta.cache_salt,
                    fork_of=meta.fork_of,  # not here (or gone): it runs on its own
                    deadlines=(meta.deadline, meta.queue_deadline),  # the ingress' originals
                )
            meta_row = (meta.tenant, meta.priority, meta.params.max_tokens)
            batch.append((i, rid, meta_row, len(meta.output_ids), add))
        for i, error in zip((b[0] for b in batch), await self._add_all(box, batch)):
            errors[i] = error
        for meta, error in zip(metas, errors):
            route = self._routes.get(meta.request_id)
            if error and (route is None or route.box is not box):  # (not a copy running)
                rid = meta.request_id
                box.put(RequestDelta(rid, [], "", True, "error", error=f"refused: {error}"))
        return errors

    async def adopt(self, consumer: str, migrated: Any, owner: Any = None) -> str | None:
        """Take over a request exported by another replica (its K/V too, if it was swapped);
        its items go to `consumer`'s channel. None when adopted, else why not."""
        self._start_reporter()
        if consumer in self._dead_consumers:
            return DEAD_CONSUMER
        if not isinstance(migrated, MigratedRequest):  # an ObjectRef nested in a Moved
            migrated = await migrated
        request = migrated.request
        rid = request.request_id
        if rid in self._routes:
            return f"duplicate request id {rid!r}"
        if migrated.kv_blocks is not None:
            self.num_imported_kv_blocks += int(migrated.kv_blocks.shape[2])
        meta_row = (request.tenant, request.priority, request.max_tokens)
        add = functools.partial(self.core.import_request, migrated)
        box = self._outbox(consumer, owner)
        return (await self._add_all(box, [(0, rid, meta_row, request.num_output_tokens, add)]))[0]

    def _resubmitted(self, meta: RequestMeta) -> MigratedRequest:
        """A request whose replica died: prompt + tokens already delivered, recomputed here.
        Built by the engine's intake (`make_request`, as `add_request` builds a new one), then
        given its output tokens (not a longer prompt) so max_tokens, seeded sampling (keyed on
        the output index) and the detokenizer carry on exactly; its prompt was charged on its
        first replica."""
        request = self.core.make_request(
            list(meta.prompt_ids),
            meta.params,
            request_id=meta.request_id,
            tenant=meta.tenant,
            priority=meta.priority,
            cache_salt=meta.cache_salt,
            deadlines=(meta.deadline, meta.queue_deadline),
            output_ids=meta.output_ids,
        )
        request.num_prompt_charged = request.num_prompt_tokens
        return MigratedRequest(request, None, {})

    async def _add_all(self, box: Outbox, batch: list[tuple]) -> list[str | None]:
        """Add a batch of requests in one trip to the engine thread; why each was refused,
        or None."""
        # Routed before they are added: a first step may end before this coroutine resumes.
        for _, rid, meta_row, num_out, _ in batch:
            self._routes[rid] = _Route(box, num_out)
            box.requests.add(rid)
            self._meta[rid] = meta_row
        self._changed = True

        def add_all() -> list[str | None]:
            out: list[str | None] = []
            for _, rid, *_, add in batch:
                if trace.ON:
                    trace.mark(rid, "engine_added")
                    trace.mark(rid, "added_step", self.engine.num_steps)
                try:
                    add()
                    out.append(None)
                except Exception as e:  # a bad request: the others still go in
                    out.append(f"{type(e).__name__}: {e}")
            return out

        try:
            errors = await self.engine.add(add_all)
        except Exception as e:  # the engine is dead
            errors = [f"{type(e).__name__}: {e}"] * len(batch)
        for (_, rid, *_), error in zip(batch, errors):
            if error is not None:
                self._routes.pop(rid, None)
                box.requests.discard(rid)
                self._meta.pop(rid, None)
        self._watch(box)
        return errors

    @ray.method(
        num_returns="streaming",
        max_task_retries=0,
        _generator_backpressure_num_objects=CHANNEL_BACKPRESSURE,
    )
    async def channel(self, consumer: str, owner: Any = None):
        """The consumer's one stream from this replica: each item is a list of everything its
        outbox gathered since the last one (one engine step's deltas, or more). A newer
        channel of the same consumer ends this one."""
        box = self._outbox(consumer, owner)
        self._watch(box)  # a forwarded submission may have made the box before its owner was known
        box.generation += 1
        generation = box.generation
        box.ready.set()  # wakes an older channel (it ends) and delivers what waited
        while True:
            await box.ready.wait()
            if box.generation != generation:
                return
            items = box.take()
            if items:
                if trace.ON:
                    for item in items:
                        trace.mark(item.request_id, "sent")
                yield items

    def _outbox(self, consumer: str, owner: Any = None) -> Outbox:
        box = self._boxes.get(consumer)
        if box is None:
            limit = self.unread_items_per_seat * max(1, self.config.max_num_seqs)
            box = self._boxes[consumer] = Outbox(consumer, owner, limit)
        elif owner is not None:
            box.owner = owner
        return box

    def _deliver(self, deltas: list[RequestDelta] | BaseException) -> None:
        """The engine's sink, on the event loop after every step."""
        if isinstance(deltas, BaseException):  # the step loop died: end every request
            error = f"the engine failed: {deltas!r}"
            for rid in list(self._routes):
                self._end(rid, RequestDelta(rid, [], "", True, "error", error=error))
            return
        # (the engine may be a step further by now: these deltas' step is the one delivered)
        steps, replica_id, routes = self.engine.delivered_step, self.replica_id, self._routes
        times = self.engine.delivered_times
        for d in deltas:
            route = routes.get(d.request_id)
            if route is None:
                continue
            if times is not None:
                _trace_step(d.request_id, steps, times)
            route.num_out += len(d.token_ids)
            d.step, d.replica_id = steps, replica_id  # (the engine's delta goes as it is)
            if d.finished:
                self._end(d.request_id, d)
            elif not route.box.put(d):
                self._stalled(route.box)

    def _end(self, rid: str, last: Any) -> None:
        """The request's last item (finished, or a Moved marker): it leaves this replica."""
        route = self._routes.pop(rid, None)
        if route is None:
            return
        route.box.requests.discard(rid)
        self._meta.pop(rid, None)
        self._finished.append((rid, route.num_out))
        self._changed = True
        if not route.box.put(last):
            self._stalled(route.box)

    def _stalled(self, box: Outbox) -> None:
        if box.consumer in self._stalling:
            return
        self._stalling.add(box.consumer)
        asyncio.get_running_loop().create_task(self._drop_consumer(box, "stalled"))

    async def _drop_consumer(self, box: Outbox, why: str) -> None:
        """Abort every request of a consumer that died or stopped reading (its unread items
        are dropped: memory stays bounded); each request ends with an error item."""
        try:
            ids = list(box.requests)
            log.warning("consumer %s %s: aborting its %d request(s)", box.consumer, why, len(ids))
            for rid in ids:
                await self.engine.call(self.core.abort, rid)
            box.items.clear()
            box.stalled = False
            if why == "stalled":
                error = f"the consumer stopped reading: over {box.limit} unread items"
            else:
                error = DEAD_CONSUMER
            for rid in ids:
                self._end(rid, RequestDelta(rid, [], "", True, "error", error=error))
        finally:
            self._stalling.discard(box.consumer)

    # ---- consumers that die -----------------------------------------------------------------

    owner_check_s = 1.0  # how often the consumers with open requests are pinged
    owner_ping_timeout_s = 10.0  # a ping this slow proves nothing: checked again next round
    unread_items_per_seat = 1024  # an outbox holds this many items per running seat at most

    def _watch(self, box: Outbox) -> None:
        if box.owner is not None and self._owner_watch is None:
            self._owner_watch = asyncio.get_running_loop().create_task(self._watch_owners())

    async def _watch_owners(self) -> None:
        while True:
            await asyncio.sleep(self.owner_check_s)
            boxes = [b for b in self._boxes.values() if b.owner is not None and b.requests]
            if boxes:
                await asyncio.gather(*(self._check_owner(b) for b in boxes))

    async def _check_owner(self, box: Outbox) -> None:
        if not await channel.owner_is_dead(box.owner, self.owner_ping_timeout_s):
            return
        # dead: nobody reads these items any more; its channel (if still open) ends too
        self._boxes.pop(box.consumer, None)
        self._dead_consumers[box.consumer] = None
        if len(self._dead_consumers) > DEAD_CONSUMERS_KEPT:
            del self._dead_consumers[next(iter(self._dead_consumers))]
        box.generation += 1
        box.ready.set()
        await self._drop_consumer(box, "died")

    async def abort(self, request_id: str) -> bool:
        """Abort a request; its consumer gets an "abort" item. False if it was not here."""
        ok = await self.engine.abort(request_id)
        if ok:
            item = RequestDelta(request_id, [], "", True, "abort")
            self._end(request_id, item)
        return ok

    # ---- controller commands ----------------------------------------------------------------

    async def preempt(
        self, request_id: str, mode: str = "auto", seat_for: str | None = None
    ) -> bool:
        """Preempt a running request; `seat_for`: the request its seat is kept for (the
        controller assigns it here with this preemption)."""
        ok = await self.engine.call(self.core.preempt, request_id, mode, seat_for)
        self._changed = True
        return ok

    async def migrate_out(
        self,
        request_id: str,
        dst_id: str,
        dst: Any,
        mode: str = "swap",
        waiting_only: bool = False,
    ) -> bool:
        """Preempt (swap, so the K/V travels), export, publish to the object store, and end the
        caller's stream with a Moved marker that names the destination. `waiting_only`: only a
        request that has not started here (waiting in the local queue); False otherwise."""
        if request_id not in self._routes:
            return False  # finished, or not started here yet

        def export() -> MigratedRequest | None:
            request = self.core.scheduler.requests.get(request_id)
            if request is None:
                return None
            if waiting_only and request.status != RequestStatus.WAITING:
                return None
            if request.status == RequestStatus.RUNNING:
                can_swap = self.core.scheduler.kv.can_swap_out(request)
                self.core.preempt(request_id, mode if can_swap else "recompute")
            return self.core.export_request(request_id)

        migrated = await self.engine.call(export)
        if migrated is None:
            return False
        ref = ray.put(migrated)  # numpy K/V: read zero-copy by the destination
        if request_id not in self._routes:  # its consumer was dropped meanwhile
            return False
        # Held here until the destination has surely read it: the ref travels nested in a
        # channel message, and Ray freed such objects before the borrower resolved them
        # (ReferenceCountingAssertionError under overload).
        self._prune_exports()
        self._exports.append((time.monotonic(), ref))
        self._end(request_id, Moved(request_id, dst_id, dst, ref))
        return True

    async def requeue(self, request_id: str) -> bool:
        """A drain sends a request back to the controller's queue: it stops here, and its
        stream ends with a `Moved` naming no replica (the client resubmits it with the tokens
        it has). False if it was not here (it ended meanwhile)."""
        if request_id not in self._routes or not await self.engine.abort(request_id):
            return False
        self._end(request_id, Moved(request_id, "", None, None))
        return True

    async def drained(self) -> bool:
        """Nothing held and every item sent: a drain may stop this replica now."""
        return not self._routes and not any(box.items for box in self._boxes.values())

    export_hold_s = 300.0  # how long a migrated request's object stays pinned at its source

    def _prune_exports(self) -> None:
        """Unpin migrated requests' objects older than `export_hold_s` (on the event loop)."""
        now = time.monotonic()
        if self._exports:
            self._exports = [(t, r) for t, r in self._exports if now - t < self.export_hold_s]

    async def set_tenant_counters(self, counters: dict[str, float]) -> None:
        await self.engine.call(self.core.scheduler.set_tenant_counters, counters)

    async def ping(self) -> str:
        return self.replica_id

    async def remove_lora(self, name: str) -> None:
        """The adapter is no longer served: dropped once the requests under it have ended."""
        await self.engine.call(self.core.remove_lora, name)

    async def check_lora(self, lora: Any) -> str | None:
        """Read and validate a LoRA adapter as this replica's engine would serve it: None when
        it can, else why not (the directory, the config, the shapes, the engine's limits)."""
        try:
            await self.engine.call(self.core.check_lora, lora)
        except ValueError as e:
            return str(e)
        return None

    async def stats(self) -> dict:
        def run() -> dict:
            s = self.core.scheduler
            return {
                "replica_id": self.replica_id,
                "num_steps": self.engine.num_steps,
                "service": s.policy.service(),
                "tokens": s.policy.tokens(),
                "counters": s.policy.counters(),
                "free_blocks": s.kv.num_free_blocks,
                "running": len(s.running),
                "waiting": s.num_waiting,
                "swapped": len(s.swapped),
                "preemptions": dict(s.num_preemptions),
                "imported_kv_blocks": self.num_imported_kv_blocks,
                "engine": self.core.stats(),
            }

        # the consumers that are actors (ingress replicas), by actor id -> requests here
        owners: dict[str, int] = {}
        for box in self._boxes.values():
            if box.owner is not None and box.requests:
                key = owner_key(box.owner)
                owners[key] = owners.get(key, 0) + len(box.requests)
        return {**await self.engine.call(run), "owners": owners}


def replica_actor(max_restarts: int = 0):
    """`Replica` as a Ray actor class: one fake-or-real GPU, no CPU reservation."""
    return ray.remote(num_gpus=1, num_cpus=0, max_restarts=max_restarts, max_concurrency=1000)(
        Replica
    )
