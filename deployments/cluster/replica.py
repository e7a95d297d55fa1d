"""The replica actor: one per GPU, owns an EngineCore and runs its step loop continuously.

Data plane (`channel.py`): consumers (an ingress replica, a handle caller, a driver) `submit`
requests in batches and read one long-lived channel each (a TCP socket of its own,
`socket_channel.py`, or a Ray stream); after every engine step the deltas of each consumer's
requests go to that consumer's outbox, and its channel takes them as one message. Tokens never
pass through the controller. Control plane: a background task reports to the controller at a
bounded rate (one report per `report_interval_s` at most, and only when something changed or
a heartbeat is due), and the controller's commands (preempt, migrate out, counters) run
between steps on the engine thread.

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
import re
import time
from dataclasses import dataclass, field
from typing import Any

from fairbatch.deployments.cluster import trace
from fairbatch.deployments.cluster.channel import (
    CHANNEL_BACKPRESSURE,
    ActorOwner,
    DriverOwner,
    Outbox,
)
from fairbatch.deployments.cluster.socket_channel import (
    ChannelServer,
    MovePending,
    Offer,
    node_address,
    serve_calls,
    write_messages,
)
from fairbatch.deployments.cluster.wire import Moved, ReplicaReport, RequestMeta, StreamItem
from fairbatch.engine.core import EngineCore, MigratedRequest, RequestDelta
from fairbatch.policies import TenantSpec
from fairbatch.scheduler import Request, RequestStatus, SchedulerConfig

log = logging.getLogger(__name__)


def ray_method(**options: Any):
    """`ray.method(...)` when Ray is installed (the class also runs without it, in tests)."""
    try:
        import ray
    except ImportError:  # pragma: no cover
        return lambda fn: fn
    return ray.method(**options)


@dataclass
class _Route:
    box: Outbox  # the consumer its items go to
    num_out: int  # output tokens it has (reported when it leaves)


@dataclass
class ReplicaConfig:
    engine: str = "sim"  # "sim", "tiny", or a Hugging Face model directory
    num_gpu_blocks: int = 256
    num_cpu_blocks: int = 256
    block_size: int = 16
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 512
    max_model_len: int = 1024
    policy: str = "priority"  # the local queue's order
    tenants: list[TenantSpec] = field(default_factory=list)
    policy_kwargs: dict = field(default_factory=dict)  # e.g. dlpm's quantum
    preemption_mode: str = "auto"
    # sim only: the modelled hardware, and real seconds slept per virtual second of step time
    # (0 = unpaced; 1 = as slow as the modelled GPU)
    sim_model: str = "llama3_8b"
    sim_gpu: str = "H100"
    sim_vocab: int = 1000
    time_scale: float = 0.0
    report_interval_s: float = 0.02
    heartbeat_s: float = 0.5
    device: str = "cpu"
    torch_threads: int = 1  # CPU model: intra-op threads per replica (replicas share cores)

    def __post_init__(self) -> None:
        """Bad values fail here, where a config is read, not in a replica starting later."""
        SchedulerConfig(  # its own checks: seats, token budget, context, preemption mode
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            preemption_mode=self.preemption_mode,
        )
        at_least = {"num_gpu_blocks": 1, "num_cpu_blocks": 0, "block_size": 1, "torch_threads": 1}
        for name, low in at_least.items():
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")
        for name in ("report_interval_s", "heartbeat_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.time_scale >= 0:
            raise ValueError(f"time_scale must be >= 0, got {self.time_scale}")
        device = self.device
        if not (device in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", device)):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")


DEAD_CONSUMER = "the consumer died"  # why a submission for a consumer found dead is refused
DEAD_CONSUMERS_KEPT = 1024  # consumer ids (one per client process) remembered as dead


def build_core(cfg: ReplicaConfig) -> EngineCore:
    """The engine factory: a simulated runner ("sim") or the real model (anything else)."""
    if cfg.engine == "sim":
        from fairbatch.engine import gpu_profiles
        from fairbatch.engine.sim_runner import SimRunner
        from fairbatch.kv.manager import KVCacheManager
        from fairbatch.policies import make_policy
        from fairbatch.scheduler import Scheduler

        shape = getattr(gpu_profiles, cfg.sim_model)()
        runner = SimRunner(shape, cfg.sim_gpu, vocab_size=cfg.sim_vocab, block_size=cfg.block_size)
        sched_cfg = SchedulerConfig(
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=cfg.max_model_len,
            preemption_mode=cfg.preemption_mode,
            kv_bytes_per_token=shape.kv_bytes_per_token,
        )
        kv = KVCacheManager(cfg.num_gpu_blocks, cfg.block_size, cfg.num_cpu_blocks)
        policy = make_policy(cfg.policy, cfg.tenants, **cfg.policy_kwargs)
        return EngineCore(Scheduler(sched_cfg, kv, policy), runner)
    import torch

    from fairbatch.engine.llm import build_engine

    if cfg.device == "cpu" and cfg.torch_threads > 0:
        torch.set_num_threads(cfg.torch_threads)
    return build_engine(
        cfg.engine,
        device=cfg.device,
        block_size=cfg.block_size,
        num_gpu_blocks=cfg.num_gpu_blocks,
        num_cpu_blocks=cfg.num_cpu_blocks,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_model_len=cfg.max_model_len,
        preemption_mode=cfg.preemption_mode,
        policy=cfg.policy,
        tenants=cfg.tenants,
        policy_kwargs=cfg.policy_kwargs,
    )


async def owner_is_dead(owner: ActorOwner | DriverOwner, timeout_s: float) -> bool:
    """True only when the GCS says the consumer's process is gone: its actor is DEAD (or no
    longer listed: the GCS forgets dead actors past a count), or a driver's job is marked
    dead. No answer in time, or any error, proves nothing: False."""
    import ray
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


def pace_step(core: EngineCore, time_scale: float) -> None:
    """After a step of a simulated engine: sleep what the step would take on its GPU, scaled by
    `time_scale` (0: no pacing). Real engines have no modelled cost and are never paced."""
    if time_scale > 0:
        cost = getattr(core.runner, "last_cost", None)
        if cost is not None and cost.total_s > 0:
            time.sleep(cost.total_s * time_scale)


def _trace_step(request_id: str, times: trace.StepTimes) -> None:
    """The step that made the request's delta (the first one counts), and its arrival here."""
    for point, value in (
        ("step_start", times.start),
        ("step_end", times.end),
        ("step_cpu", times.cpu),
        ("step_wait", times.wait),
        ("delivered", None),
    ):
        trace.mark(request_id, point, value)


def owner_key(owner: ActorOwner | DriverOwner) -> str:
    """An owner's id, for stats: the actor's id, or "job:<id>" for a driver."""
    if isinstance(owner, DriverOwner):
        return f"job:{owner.job_id}"
    return owner.actor_id


class Replica:
    def __init__(
        self,
        replica_id: str,
        config: ReplicaConfig,
        controller_name: str | None = None,
        namespace: str | None = None,
    ) -> None:
        from fairbatch.engine.async_engine import AsyncEngine

        self.replica_id = replica_id
        self.config = config
        self.core = build_core(config)
        self.time_scale = config.time_scale
        self.engine = AsyncEngine(self.core, step_hook=self._pace, sink=self._deliver)
        if trace.ON:
            self.engine.step_clock = trace.StepClock()
        self._routes: dict[str, _Route] = {}  # request id -> where its items go
        self._boxes: dict[str, Outbox] = {}  # consumer id -> its unread items
        # consumers found dead (oldest first, at most DEAD_CONSUMERS_KEPT): a submission for one
        # comes from the controller, which still had its queued requests, and is refused
        self._dead_consumers: dict[str, None] = {}
        self._stalling: set[str] = set()  # consumers whose requests are being dropped
        self._exports: list[tuple[float, Any]] = []  # (time, ObjectRef) of migrated requests
        self._moves: dict[str, tuple[float, Moved]] = {}  # announced on a socket, not fetched
        self._socket: ChannelServer | None = None  # channel sockets, from the first one asked
        self._finished: list[tuple[str, int]] = []  # (id, output tokens) left since last report
        self._meta: dict[str, tuple[str, int, int]] = {}  # id -> (tenant, priority, max_tokens)
        self._changed = True
        self._seq = 0
        self._hash_count = -1
        self.num_imported_kv_blocks = 0
        self.controller_name = controller_name
        self.namespace = namespace
        self._reporter: asyncio.Task | None = None
        self._controller: Any = None
        self._owner_watch: asyncio.Task | None = None

    def _pace(self) -> None:
        pace_step(self.core, self.time_scale)  # on the engine thread, after each step

    # ---- data plane -------------------------------------------------------------------------

    async def submit(
        self, consumer: str, metas: list[RequestMeta], owner: Any = None, forwarded: bool = False
    ) -> list[str | None]:
        """Start new (or resubmitted) requests whose items go to `consumer`'s channel. Returns
        one entry per request: None when it was added, else why it was refused. `owner`: the
        consumer's process (`ActorOwner`, or a driver's `DriverOwner`), watched so its
        requests end if it dies; None when not known yet (its channel brings it).
        `forwarded`: sent by the controller for the consumer, which is not waiting for this
        answer: a refusal also goes to the consumer as the request's last item, and a request
        already here for the consumer counts as added (the controller restarted and placed it
        again)."""
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
            if forwarded and route is not None and route.box is box:
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
        if forwarded:
            for meta, error in zip(metas, errors):
                route = self._routes.get(meta.request_id)
                if error and (route is None or route.box is not box):  # (not a copy running)
                    rid = meta.request_id
                    box.put(
                        StreamItem([], "", True, "error", error=f"refused: {error}", request_id=rid)
                    )
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
        Rebuilt with its output tokens (not as a longer prompt) so max_tokens, seeded sampling
        (keyed on the output index) and the detokenizer carry on exactly."""
        params = meta.params
        stop_ids = list(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop_ids.extend(self.core.eos_token_ids)
        request = Request(
            meta.request_id,
            list(meta.prompt_ids),
            params.max_tokens,
            tenant=meta.tenant,
            priority=meta.priority,
            stop_token_ids=stop_ids,
            cache_salt=meta.cache_salt,
            sampling_params=params,
        )
        for token in meta.output_ids:
            request.append_output_token(token)
        request.num_prompt_charged = request.num_prompt_tokens  # charged on the first replica
        return MigratedRequest(request, None, {"deadlines": (meta.deadline, meta.queue_deadline)})

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

    @ray_method(
        num_returns="streaming",
        max_task_retries=0,
        _generator_backpressure_num_objects=CHANNEL_BACKPRESSURE,
    )
    async def channel(self, consumer: str, owner: Any = None):
        """The consumer's one stream from this replica over Ray (`channel_socket` is the
        default): each item is a list of everything its outbox gathered since the last one
        (one engine step's deltas, or more). A newer channel of the same consumer ends this
        one."""
        async for items in self._messages(consumer, owner):
            yield items

    async def channel_socket(self, consumer: str, owner: Any = None) -> Offer:
        """The consumer's channel as a TCP socket of its own (`socket_channel`): where to
        connect, with the tokens that prove both ends. The channel opens on connecting."""
        self._watch(self._outbox(consumer, owner))
        return await self._channel_server().offer(consumer)

    async def call_socket(self, caller: str) -> Offer:
        """An offer of calls over this replica's socket (`socket_channel.CallClient`): the
        controller's forwarded submissions and preemptions."""
        return await self._channel_server().offer(caller, self._serve_calls)

    def _channel_server(self) -> ChannelServer:
        if self._socket is None:
            self._socket = ChannelServer(node_address(), self._serve_socket)
        return self._socket

    async def _serve_calls(self, caller: str, reader: Any, writer: Any) -> None:
        await serve_calls({"submit": self.submit, "preempt": self.preempt}, reader, writer)

    async def _serve_socket(self, consumer: str, reader: Any, writer: Any) -> None:
        async def framed():
            async for items in self._messages(consumer):
                yield [self._plain(item) for item in items]

        await write_messages(framed(), reader, writer)

    def _plain(self, item: Any) -> Any:
        """`item` as plain data for a socket frame: a move to another replica waits here for
        `moved()` (its handle and ObjectRef travel over Ray)."""
        if isinstance(item, Moved) and item.replica is not None:
            self._moves[item.request_id] = (time.monotonic(), item)
            return MovePending(item.request_id)
        return item

    async def moved(self, request_id: str) -> Moved | None:
        """The `Moved` a socket frame announced as `MovePending` (None if not here)."""
        entry = self._moves.pop(request_id, None)
        return None if entry is None else entry[1]

    async def _messages(self, consumer: str, owner: Any = None):
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
                self._end(rid, StreamItem([], "", True, "error", error=error, request_id=rid))
            return
        # (the engine may be a step further by now: these deltas' step is the one delivered)
        steps, replica_id, routes = self.engine.delivered_step, self.replica_id, self._routes
        times = self.engine.delivered_times
        for d in deltas:
            route = routes.get(d.request_id)
            if route is None:
                continue
            if times is not None:
                _trace_step(d.request_id, times)
            route.num_out += len(d.token_ids)
            item = StreamItem(
                d.token_ids,
                d.text,
                d.finished,
                d.finish_reason,
                steps,
                replica_id,
                logprobs=d.logprobs,
                request_id=d.request_id,
                prompt_logprobs=d.prompt_logprobs,
                num_cached_tokens=d.num_cached_tokens,
            )
            if d.finished:
                self._end(d.request_id, item)
            elif not route.box.put(item):
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
                self._end(rid, StreamItem([], "", True, "error", error=error, request_id=rid))
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
        if not await owner_is_dead(box.owner, self.owner_ping_timeout_s):
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
            item = StreamItem([], "", True, "abort", request_id=request_id)
            self._end(request_id, item)
        return ok

    # ---- controller commands ----------------------------------------------------------------

    async def preempt(self, request_id: str, mode: str = "auto") -> bool:
        ok = await self.engine.call(self.core.preempt, request_id, mode)
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
        import ray

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
        """Unpin migrated requests' objects older than `export_hold_s`, and forget moves not
        fetched by then (on the event loop)."""
        now = time.monotonic()
        if self._exports:
            self._exports = [(t, r) for t, r in self._exports if now - t < self.export_hold_s]
        for rid, (t, _) in list(self._moves.items()):
            if now - t >= self.export_hold_s:
                del self._moves[rid]

    async def set_tenant_counters(self, counters: dict[str, float]) -> None:
        await self.engine.call(self.core.scheduler.set_tenant_counters, counters)

    async def set_time_scale(self, time_scale: float) -> None:
        self.time_scale = time_scale

    async def ping(self) -> str:
        return self.replica_id

    async def check(self) -> dict:
        """Pool integrity (raises if broken) and whether everything is free again."""

        def run() -> dict:
            self.core.check_integrity()
            return {
                "all_free": self.core.scheduler.kv.all_free(),
                "requests": len(self.core.scheduler.requests),
            }

        return await self.engine.call(run)

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

    # ---- reports ----------------------------------------------------------------------------

    def _start_reporter(self) -> None:
        if self._reporter is None and self.controller_name is not None:
            self._reporter = asyncio.get_running_loop().create_task(self._report_loop())

    async def start(self) -> str:
        """Begin reporting (the cluster builder calls this once the actor is up)."""
        self._start_reporter()
        return self.replica_id

    async def _report_loop(self) -> None:
        import ray

        cfg = self.config
        last_sent = 0.0
        handle = None
        while True:
            await asyncio.sleep(cfg.report_interval_s)
            self._prune_exports()  # also when no migration comes after the last one
            now = time.monotonic()
            if not self._changed and now - last_sent < cfg.heartbeat_s:
                continue
            try:
                if self._controller is None:
                    self._controller = ray.get_actor(self.controller_name, self.namespace)
                if handle is None:
                    handle = ray.get_runtime_context().current_actor
                report = await self.engine.call(self._report, handle)
                counters = await asyncio.wait_for(
                    self._controller.report.remote(report), timeout=max(2.0, cfg.heartbeat_s)
                )
                del self._finished[: len(report.finished)]
                last_sent = now
                if counters:
                    await self.set_tenant_counters(counters)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # controller restarting or gone: keep serving, retry later
                log.debug("report failed: %r", e)
                self._changed = True
                await asyncio.sleep(min(1.0, 10 * cfg.report_interval_s))

    def _report(self, handle: Any) -> ReplicaReport:
        # On the engine thread, between steps: a consistent view of the scheduler.
        s = self.core.scheduler
        kv = s.kv
        self._changed = False
        self._seq += 1
        cached = kv.gpu_pool.cached
        running = {r.request_id for r in s.running}
        # not in the scheduler: ended (its last items on their way) or still being added;
        # reported as started, so that the controller does not move it as a waiting one
        held = s.requests
        num_out = self._num_out
        hashes = None
        if len(cached) != self._hash_count or self._seq % 25 == 0:
            self._hash_count = len(cached)
            hashes = list(cached)[-4096:]
        return ReplicaReport(
            replica_id=self.replica_id,
            seq=self._seq,
            max_num_seqs=s.config.max_num_seqs,
            free_blocks=kv.num_free_blocks,
            total_blocks=kv.gpu_pool.num_blocks,
            block_size=kv.block_size,
            num_waiting=s.num_waiting,
            num_running=len(s.running),
            num_swapped=len(s.swapped),
            num_steps=self.engine.num_steps,
            # raw (prefill, decode) tokens per tenant: the controller pre-charges prompts at
            # admission and takes only the decode part
            service=s.policy.tokens(),
            finished=list(self._finished),
            active={
                rid: (tenant, prio, rid in running or rid not in held, max_tokens, num_out(rid))
                for rid, (tenant, prio, max_tokens) in list(self._meta.items())
            },
            prefix_hashes=hashes,
            handle=handle,
        )

    def _num_out(self, rid: str) -> int:
        request = self.core.scheduler.requests.get(rid)
        return 0 if request is None else request.num_output_tokens


def replica_actor(max_restarts: int = 0):
    """`Replica` as a Ray actor class: one fake-or-real GPU, no CPU reservation."""
    import ray

    return ray.remote(num_gpus=1, num_cpus=0, max_restarts=max_restarts, max_concurrency=1000)(
        Replica
    )
