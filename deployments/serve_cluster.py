"""The cluster behind the Serve ingress: named controller + one replica actor per GPU, and the
`ClusterBackend` adapter that gives `ClusterClient` the API's backend protocol.

Why not `cluster.start_cluster`: the ingress runs inside a Serve replica that Serve may replace
(a redeploy starts the new ingress before it stops the old one), so the controller here is
*detached*, created with `get_if_exists` (a second ingress replica, or the next version, finds
the running cluster by name; its `ensure_replicas` finds the replicas in service, replacements
included), and counted: every ingress `attach`es, and the last one to `detach` tears the
cluster down. The cluster's name carries a digest of its settings, so a
redeploy that changes the engine or the replica count builds a new cluster next to the old
one (which goes when the old ingress detaches); one that changes only tenants keeps it.

`ClusterController` and `ClusterReplica` subclass the cluster layer's classes to add what the
ingress needs there (run-time tenant updates, metrics, attach counting, a tokenizer on sim
replicas so the API gets text and stop strings); see the report in docs/SERVE.md for the
changes that would let these live in `controller.py` / `replica.py` instead.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import ray

from fairbatch.deployments.client import ClusterClient
from fairbatch.deployments.controller import Controller
from fairbatch.deployments.fairness import ControllerConfig
from fairbatch.deployments.metrics import Deltas, RequestTimer, get_metrics
from fairbatch.deployments.replica import Replica, ReplicaConfig, actor_is_dead
from fairbatch.deployments.replica_set import ReplicaSet, ReplicaSpec
from fairbatch.engine.core import RequestDelta
from fairbatch.engine.sampling_params import SamplingParams
from fairbatch.policies import TenantSpec

log = logging.getLogger(__name__)

NAMESPACE = "fairbatch"  # the cluster's actors live here, whatever job the ingress runs in
UPDATE_TIMEOUT_S = 15.0  # tenant pushes to the controller and each replica
HEALTH_TIMEOUT_S = 5.0


def _spawn(coro: Any, tasks: set) -> None:
    task = asyncio.get_running_loop().create_task(coro)
    tasks.add(task)
    task.add_done_callback(tasks.discard)


# ---- actors -----------------------------------------------------------------------------------


class ClusterController(Controller):
    """The controller plus: tenant updates, ingress attach counting, periodic metrics. It owns
    the replicas (`ensure_replicas`, replacement of dead ones); the last ingress to detach
    stops them."""

    def __init__(
        self,
        config: ControllerConfig,
        metrics_interval_s: float = 1.0,
        replicas: ReplicaSet | None = None,
    ) -> None:
        super().__init__(config, replicas)
        self.users: dict[str, Any] = {}  # attached ingress -> its actor handle (None: unknown)
        self.metrics_interval_s = metrics_interval_s
        self._metrics_task: asyncio.Task | None = None
        self._tenant_updates: dict[str, tuple[float, int]] = {}  # for replacement replicas

    async def attach(self, user: str, handle: Any = None) -> int:
        """Count an ingress in. With its actor `handle`, an ingress that dies without
        detaching (killed) stops counting at the next detach."""
        self.users[user] = handle
        if self._metrics_task is None and self.metrics_interval_s > 0:
            self._metrics_task = asyncio.get_running_loop().create_task(self._metrics_loop())
        return len(self.users)

    async def detach(self, user: str) -> int:
        """Returns how many live ingresses still use the cluster (0: tear it down). The last
        one out stops the replicas here first, so none is replaced (the ingress then kills the
        actors it knows, which no longer include replacements)."""
        self.users.pop(user, None)
        await self._forget_dead_users()
        if not self.users and self.supervisor is not None:
            await self.shutdown_replicas()
        return len(self.users)

    async def _forget_dead_users(self) -> None:
        users = [(u, h) for u, h in self.users.items() if h is not None]
        verdicts = await asyncio.gather(*(actor_is_dead(h, UPDATE_TIMEOUT_S) for _, h in users))
        for (user, _), is_dead in zip(users, verdicts):
            if is_dead:
                log.info("ingress %s died without detaching: no longer counted", user)
                self.users.pop(user, None)

    async def update_tenant(self, name: str, weight: float, priority: int) -> None:
        """The global queue's tenant, and (in the background) every replica's in service; a
        replacement starts with it (`_replica_config`)."""
        self._tenant_updates[name] = (weight, priority)
        self.core.policy.update_tenant(name, weight=weight, priority=priority)
        self._apply(self.core.dispatch())
        update = {name: (weight, priority)}
        _spawn(self._push_tenants(list(self.handles.values()), update), self._tasks)

    async def _push_tenants(self, handles: list, updates: dict[str, tuple[float, int]]) -> None:
        calls = [h.update_tenant.remote(n, w, p) for h in handles for n, (w, p) in updates.items()]
        results = await asyncio.wait_for(
            asyncio.gather(*calls, return_exceptions=True), UPDATE_TIMEOUT_S
        )
        for r in results:
            if isinstance(r, Exception):  # a dead replica: the replacement starts updated
                log.info("tenant update not delivered: %r", r)

    def _replica_config(self, spec: ReplicaSpec) -> ReplicaConfig:
        if not self._tenant_updates:
            return spec.config
        tenants = {t.name: t for t in spec.config.tenants}
        for name, (weight, priority) in self._tenant_updates.items():
            base = tenants.get(name) or TenantSpec(name)
            tenants[name] = replace(base, weight=weight, priority=priority)
        return replace(spec.config, tenants=list(tenants.values()))

    def _on_registered(self, replica_id: str, handle: Any) -> None:
        # an update made while this replica was being created reaches it too
        if self._tenant_updates:
            _spawn(self._push_tenants([handle], dict(self._tenant_updates)), self._tasks)

    async def tenants(self) -> dict[str, tuple[float, int]]:
        """name -> (weight, priority), as the global queue's policy has them."""
        policy = self.core.policy
        return {n: (policy.tenant(n).weight, policy.tenant(n).priority) for n in policy._specs}

    async def _metrics_loop(self) -> None:
        m = get_metrics()
        deltas = Deltas()
        while True:
            try:
                core = self.core
                m.queue_depth.set(len(core.policy), tags={"replica": "controller"})
                for tenant, value in core.counters().items():
                    m.tenant_counter.set(value, tags={"tenant": tenant})
                for tenant, value in core.policy.service().items():
                    m.tenant_service.set(value, tags={"tenant": tenant})
                deltas.inc(m.migrations, core.num_migrations, {})
            except Exception as e:  # metrics never take the controller down
                log.debug("controller metrics failed: %r", e)
            await asyncio.sleep(self.metrics_interval_s)


class ClusterReplica(Replica):
    """The replica plus: run-time tenant updates, periodic metrics, and for `engine="sim"`
    the tiny tokenizer (sim tokens are ids below its vocabulary), so text and stop strings
    work through the API as with a real model."""

    def __init__(
        self,
        replica_id: str,
        config: ReplicaConfig,
        controller_name: str | None = None,
        namespace: str | None = None,
        metrics_interval_s: float = 1.0,
    ) -> None:
        if config.device == "auto":  # a Ray GPU may be fake: ask torch, never Ray
            import torch

            config = replace(config, device="cuda" if torch.cuda.is_available() else "cpu")
        super().__init__(replica_id, config, controller_name, namespace)
        if config.engine == "sim" and self.core.tokenizer is None:
            from fairbatch.engine.tokenizer import Tokenizer

            tok = Tokenizer.tiny()
            self.core.tokenizer = tok
            self.core.eos_token_ids = tuple(tok.eos_token_ids)
        self.metrics_interval_s = metrics_interval_s
        self._metrics_task: asyncio.Task | None = None

    async def start(self) -> str:
        if self._metrics_task is None and self.metrics_interval_s > 0:
            self._metrics_task = asyncio.get_running_loop().create_task(self._metrics_loop())
        return await super().start()

    async def update_tenant(self, name: str, weight: float, priority: int) -> None:
        policy = self.core.scheduler.policy
        await self.engine.call(policy.update_tenant, name, weight=weight, priority=priority)

    def _snapshot(self) -> dict:
        s = self.core.scheduler
        kv = s.kv
        total = kv.gpu_pool.num_blocks
        block_bytes = getattr(s.config, "kv_bytes_per_token", 0) * kv.block_size
        return {
            "waiting": s.num_waiting,
            "running": len(s.running),
            "swapped": len(s.swapped),
            "kv_usage": (total - kv.num_free_blocks) / total if total else 0.0,
            "preemptions": dict(s.num_preemptions),
            "swapped_bytes": {k: v * block_bytes for k, v in s.num_swapped_blocks.items()},
        }

    async def _metrics_loop(self) -> None:
        m = get_metrics()
        deltas = Deltas()
        tag = {"replica": self.replica_id}
        while True:
            try:
                snap = await self.engine.call(self._snapshot)
                m.queue_depth.set(snap["waiting"], tags=tag)
                m.running.set(snap["running"], tags=tag)
                m.swapped.set(snap["swapped"], tags=tag)
                m.kv_usage.set(snap["kv_usage"], tags=tag)
                for mode, n in snap["preemptions"].items():
                    deltas.inc(m.preemptions, n, {**tag, "mode": mode})
                for direction, n in snap["swapped_bytes"].items():
                    deltas.inc(m.swapped_bytes, n, {**tag, "direction": direction})
            except Exception as e:
                log.debug("replica metrics failed: %r", e)
            await asyncio.sleep(self.metrics_interval_s)


# ---- starting or finding the cluster ------------------------------------------------------------


@dataclass
class ClusterSpec:
    """What the ingress asks for: the cluster's identity is a digest of all of it."""

    name: str
    replicas: list[ReplicaConfig]
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    num_gpus_per_replica: float = 1.0
    metrics_interval_s: float = 1.0

    def cluster_id(self) -> str:
        body = repr(
            (
                [asdict(r) for r in self.replicas],
                asdict(self.controller),
                self.num_gpus_per_replica,
            )
        )
        return f"{self.name}-{hashlib.sha256(body.encode()).hexdigest()[:8]}"

    def replica_set(self, timeout_s: float) -> ReplicaSet:
        """The replicas as the controller starts (and replaces) them: `ClusterReplica`s with
        these configs and GPUs, named `<cluster id>-r<i>` (replacements `<...>-r<i>~<hex>`)."""
        cid = self.cluster_id()
        return ReplicaSet(
            f"{cid}-controller",
            [ReplicaSpec(f"{cid}-r{i}", cfg) for i, cfg in enumerate(self.replicas)],
            actor_cls=ClusterReplica,
            kwargs={"metrics_interval_s": self.metrics_interval_s},
            namespace=NAMESPACE,
            num_gpus=self.num_gpus_per_replica,
            start_timeout_s=timeout_s,
        )


@dataclass
class ClusterHandles:
    cluster_id: str
    controller: Any
    replicas: dict[str, Any]  # replica id -> handle, when ensured (now: controller.replica_handles)
    namespace: str | None


async def ensure_cluster(spec: ClusterSpec, timeout_s: float) -> ClusterHandles:
    """Create the cluster's detached controller, or find it by name; it creates the replicas
    it does not find (`ensure_replicas`: a second ingress finds them all in service) and this
    waits until every one has reported (bounded by `timeout_s`)."""
    cid = spec.cluster_id()
    ctrl_cls = ray.remote(ClusterController)
    controller = ctrl_cls.options(
        name=f"{cid}-controller",
        namespace=NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        num_cpus=0,
        max_restarts=-1,
        max_task_retries=-1,
        max_concurrency=10000,
    ).remote(spec.controller, spec.metrics_interval_s, spec.replica_set(timeout_s))
    replicas = await asyncio.wait_for(
        controller.ensure_replicas.remote(timeout_s), timeout=timeout_s + 30
    )
    return ClusterHandles(cid, controller, replicas, NAMESPACE)


def kill_cluster(handles: ClusterHandles) -> None:
    for h in handles.replicas.values():
        try:
            ray.kill(h, no_restart=True)
        except Exception:
            pass
    try:
        ray.kill(handles.controller, no_restart=True)
    except Exception:
        pass


# ---- the backend adapter ------------------------------------------------------------------------


class ClusterBackend:
    """The API's backend protocol (see `openai_api`) over `ClusterClient`, plus metrics."""

    def __init__(
        self,
        handles: ClusterHandles,
        tokenizer: Any,
        max_model_len: int,
        *,
        block_size: int = 16,
        admit_timeout_s: float = 120.0,
        item_timeout_s: float = 120.0,
        record_metrics: bool = True,
    ) -> None:
        self.handles = handles
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.client = ClusterClient(
            handles.controller,
            block_size=block_size,
            admit_timeout_s=admit_timeout_s,
            item_timeout_s=item_timeout_s,
        )
        self._metrics = get_metrics() if record_metrics else None
        self._tasks: set[asyncio.Task] = set()

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        request_id: str,
        tenant: str,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestDelta]:
        timer = RequestTimer(tenant, time.monotonic)
        inner = self.client.generate(
            list(prompt_token_ids),
            params,
            tenant=tenant,
            priority=priority,
            request_id=request_id,
            cache_salt=cache_salt,  # None: salted with the tenant (replicas and affinity)
        )
        reason = "abort"
        try:
            async for item in inner:
                timer.tokens_out(len(item.token_ids), item.replica_id)
                if item.error:
                    log.warning("request_id=%s failed in the cluster: %s", request_id, item.error)
                yield RequestDelta(
                    request_id,
                    list(item.token_ids),
                    item.text,
                    item.finished,
                    item.finish_reason,
                    item.logprobs,
                )
                if item.finished:
                    reason = item.finish_reason or "stop"
                    return
        finally:
            # Closing the client's generator cancels at the controller and aborts on the
            # replica; shielded so a cancelled caller cannot cut that short.
            try:
                await asyncio.shield(inner.aclose())
            finally:
                if self._metrics is not None:
                    timer.record(self._metrics, reason, len(prompt_token_ids))

    async def abort(self, request_id: str) -> bool:
        return await self.client.abort(request_id, timeout_s=UPDATE_TIMEOUT_S)

    async def update_tenant(
        self, name: str, weight: float, priority: int, tokens_per_minute: float | None
    ) -> None:
        # Quotas are enforced at the ingress (at admission); the cluster gets share and class.
        # The controller keeps the change (a replacement replica starts with it) and pushes it
        # to every replica in service, so no handle here can be stale.
        await asyncio.wait_for(
            self.handles.controller.update_tenant.remote(name, weight, priority),
            timeout=UPDATE_TIMEOUT_S,
        )

    async def check_health(self) -> bool:
        await asyncio.wait_for(self.handles.controller.ready.remote(0), HEALTH_TIMEOUT_S)
        return True

    async def stats(self) -> dict:
        """The replicas' engine counters summed (`EngineCore.stats()` keys), plus the
        controller's own view under "controller"."""

        async def gather() -> dict:
            controller = await self.handles.controller.stats.remote()
            handles = await self.handles.controller.replica_handles.remote()
            replicas = await asyncio.gather(*(h.stats.remote() for h in handles.values()))
            total = sum_engine_stats([r["engine"] for r in replicas])
            total["replicas"] = len(replicas)
            total["controller"] = controller
            return total

        return await asyncio.wait_for(gather(), UPDATE_TIMEOUT_S)


def sum_engine_stats(stats: list[dict]) -> dict:
    """Counters and occupancies added up; `kv_usage` averaged."""
    total: dict = {}
    for s in stats:
        for key, value in s.items():
            if isinstance(value, dict):
                inner = total.setdefault(key, {})
                for k, v in value.items():
                    inner[k] = inner.get(k, 0) + v
            else:
                total[key] = total.get(key, 0) + value
    if stats:
        total["kv_usage"] = total.get("kv_usage", 0.0) / len(stats)
    return total
