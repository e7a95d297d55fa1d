"""The replica actor: one per GPU, owns an EngineCore and runs its step loop continuously.

Data plane only: `generate` / `resume` are async generators that Ray streams straight to the
caller (`.options(num_returns="streaming")`), so tokens never pass through the controller.
Control plane: a background task reports to the controller at a bounded rate (one report per
`report_interval_s` at most, and only when something changed or a heartbeat is due), and the
controller's commands (preempt, migrate out, counters) run between steps on the engine thread.

A caller that dies does not end its streams: Ray keeps running an actor's streaming generator
after the process consuming it is gone. So a caller that is an actor (the ingress) names
itself with each stream, and the replica pings those callers every `owner_check_s`; the
requests of one that is dead are aborted, which frees their KV blocks and, through the next
report, the controller's slots.

`Replica` is a plain class; `replica_actor()` wraps it for Ray with `num_gpus=1, num_cpus=0`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from fairbatch.deployments.types import Moved, ReplicaReport, RequestMeta, StreamItem
from fairbatch.engine.core import EngineCore, MigratedRequest, RequestDelta
from fairbatch.policies import TenantSpec
from fairbatch.scheduler import Request, RequestStatus

log = logging.getLogger(__name__)


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
    preemption_mode: str = "auto"
    # sim only: the modelled hardware, and real seconds slept per virtual second of step time
    # (0 = unpaced; 1 = as slow as the modelled GPU)
    sim_model: str = "llama3_8b"
    sim_gpu: str = "H100"
    sim_vocab: int = 1000
    time_scale: float = 0.0
    report_interval_s: float = 0.02
    heartbeat_s: float = 0.5
    stream_batch: int = 1  # tokens per stream item at most (1 = every token at once)
    device: str = "cpu"
    torch_threads: int = 1  # CPU model: intra-op threads per replica (replicas share cores)


def build_core(cfg: ReplicaConfig) -> EngineCore:
    """The engine factory: a simulated runner ("sim") or the real model (anything else)."""
    if cfg.engine == "sim":
        from fairbatch.engine import gpu_profiles
        from fairbatch.engine.sim_runner import SimRunner
        from fairbatch.kv.manager import KVCacheManager
        from fairbatch.policies import make_policy
        from fairbatch.scheduler import Scheduler, SchedulerConfig

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
        return EngineCore(Scheduler(sched_cfg, kv, make_policy(cfg.policy, cfg.tenants)), runner)
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
    )


async def actor_is_dead(handle: Any, timeout_s: float) -> bool:
    """True only when Ray says the actor behind `handle` died (ActorDiedError). Unreachable
    for now, slow to answer, or any other error is not proof of death: False."""
    from ray.exceptions import ActorUnavailableError, RayActorError

    try:
        await asyncio.wait_for(handle.__ray_ready__.remote(), timeout_s)
    except ActorUnavailableError:  # a subclass of RayActorError: not known dead
        return False
    except RayActorError:
        return True
    except Exception:
        return False
    return False


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
        self.engine = AsyncEngine(self.core, step_hook=self._pace)
        self._moves: dict[str, Moved] = {}
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
        self._owners: dict[str, tuple[Any, set[str]]] = {}  # caller actor id -> (handle, ids)
        self._owner_watch: asyncio.Task | None = None

    def _pace(self) -> None:
        # On the engine thread after each step: a sim replica takes as long as its GPU would.
        if self.time_scale > 0:
            cost = getattr(self.core.runner, "last_cost", None)
            if cost is not None and cost.total_s > 0:
                time.sleep(cost.total_s * self.time_scale)

    # ---- data plane -------------------------------------------------------------------------

    async def generate(self, meta: RequestMeta, owner: tuple[str, Any] | None = None):
        """Stream a new (or resubmitted) request's tokens as StreamItems. `owner`: the calling
        actor's (id, handle), watched so its requests end if it dies; None for a driver."""
        self._start_reporter()
        rid = meta.request_id
        self._meta[rid] = (meta.tenant, meta.priority, meta.params.max_tokens)
        self._changed = True
        if meta.output_ids:
            stream = self.engine.resume(self._resubmitted(meta))
        else:
            stream = self.engine.generate(
                list(meta.prompt_ids),
                meta.params,
                request_id=rid,
                tenant=meta.tenant,
                priority=meta.priority,
                cache_salt=meta.cache_salt,
            )
        async for item in self._relay(rid, stream, len(meta.output_ids), owner):
            yield item

    async def resume(self, migrated: Any, owner: tuple[str, Any] | None = None):
        """Adopt a request exported by another replica (its K/V too, if it was swapped)."""
        self._start_reporter()
        if not isinstance(migrated, MigratedRequest):  # an ObjectRef nested in a Moved
            migrated = await migrated
        request = migrated.request
        rid = request.request_id
        self._meta[rid] = (request.tenant, request.priority, request.max_tokens)
        self._changed = True
        if migrated.kv_blocks is not None:
            self.num_imported_kv_blocks += int(migrated.kv_blocks.shape[2])
        num_out = request.num_output_tokens
        async for item in self._relay(rid, self.engine.resume(migrated), num_out, owner):
            yield item

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
        return MigratedRequest(request)

    async def _relay(self, rid: str, stream, num_out: int = 0, owner=None):
        batch = max(1, self.config.stream_batch)
        tokens: list[int] = []
        logprobs: list = []  # the sampler's records for `tokens`, when the request asked
        text = ""
        self._own(rid, owner)
        try:
            async for delta in stream:
                if delta.finish_reason == "moved":
                    if tokens:
                        yield self._item(tokens, text, False, None, logprobs)
                    yield self._moves.pop(rid)
                    return
                tokens.extend(delta.token_ids)
                num_out += len(delta.token_ids)
                text += delta.text
                if delta.logprobs:
                    logprobs.extend(delta.logprobs)
                if delta.finished or len(tokens) >= batch:
                    yield self._item(tokens, text, delta.finished, delta.finish_reason, logprobs)
                    tokens, logprobs, text = [], [], ""
        finally:
            self._disown(rid, owner)
            self._meta.pop(rid, None)
            self._finished.append((rid, num_out))
            self._changed = True

    # ---- callers that die -------------------------------------------------------------------

    owner_check_s = 1.0  # how often the callers of open streams are pinged
    owner_ping_timeout_s = 10.0  # a ping this slow proves nothing: checked again next round

    def _own(self, rid: str, owner: tuple[str, Any] | None) -> None:
        if owner is None:
            return
        actor_id, handle = owner
        entry = self._owners.get(actor_id)
        if entry is None:
            entry = self._owners[actor_id] = (handle, set())
        entry[1].add(rid)
        if self._owner_watch is None:
            self._owner_watch = asyncio.get_running_loop().create_task(self._watch_owners())

    def _disown(self, rid: str, owner: tuple[str, Any] | None) -> None:
        if owner is None:
            return
        entry = self._owners.get(owner[0])
        if entry is not None:
            entry[1].discard(rid)
            if not entry[1]:
                del self._owners[owner[0]]

    async def _watch_owners(self) -> None:
        while True:
            await asyncio.sleep(self.owner_check_s)
            owners = list(self._owners.items())
            if owners:
                await asyncio.gather(*(self._check_owner(a, h, ids) for a, (h, ids) in owners))

    async def _check_owner(self, actor_id: str, handle: Any, ids: set[str]) -> None:
        if not await actor_is_dead(handle, self.owner_ping_timeout_s):
            return
        # dead: nobody reads these streams any more
        log.info("caller %s died: aborting its %d request(s)", actor_id, len(ids))
        self._owners.pop(actor_id, None)
        for rid in list(ids):
            await self.engine.abort(rid)  # its stream ends with "abort"; blocks free now

    def _item(self, tokens: list[int], text: str, done: bool, reason, lps: list) -> StreamItem:
        steps, lp = self.engine.num_steps, list(lps) or None
        return StreamItem(list(tokens), text, done, reason, steps, self.replica_id, logprobs=lp)

    async def abort(self, request_id: str) -> bool:
        return await self.engine.abort(request_id)

    # ---- controller commands ----------------------------------------------------------------

    async def preempt(self, request_id: str, mode: str = "auto") -> bool:
        ok = await self.engine.call(self.core.preempt, request_id, mode)
        self._changed = True
        return ok

    async def migrate_out(self, request_id: str, dst_id: str, dst: Any, mode: str = "swap") -> bool:
        """Preempt (swap, so the K/V travels), export, publish to the object store, and end the
        caller's stream with a Moved marker that names the destination."""
        import ray

        if request_id not in self.engine._streams:
            return False  # finished, or its caller has not attached yet

        def export() -> MigratedRequest | None:
            request = self.core.scheduler.requests.get(request_id)
            if request is None:
                return None
            if request.status == RequestStatus.RUNNING:
                can_swap = self.core.scheduler.kv.can_swap_out(request)
                self.core.preempt(request_id, mode if can_swap else "recompute")
            return self.core.export_request(request_id)

        migrated = await self.engine.call(export)
        if migrated is None:
            return False
        ref = ray.put(migrated)  # numpy K/V: read zero-copy by the destination
        self._moves[request_id] = Moved(request_id, dst_id, dst, ref)
        queue = self.engine._streams.get(request_id)
        if queue is None:  # the caller left meanwhile: nobody will resume it
            self._moves.pop(request_id, None)
            return False
        queue.put_nowait(RequestDelta(request_id, [], "", True, "moved"))
        return True

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

        owners = {a: len(ids) for a, (_, ids) in self._owners.items()}  # caller -> streams
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
                rid: (tenant, prio, rid in running, max_tokens, self._num_out(rid))
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
