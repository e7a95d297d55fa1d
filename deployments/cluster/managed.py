"""The cluster classes as the Serve app runs them: `ClusterController` and `ClusterReplica`
subclass the controller and the replica to add run-time tenant updates, periodic metrics,
ingress attach counting, and a tokenizer on sim replicas (so the API gets text and stop
strings). `launch.ensure_cluster` starts these.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Any

from fairbatch.deployments.cluster.admin_store import (
    AdminChanges,
    Changes,
    LoRASettings,
    TenantSettings,
)
from fairbatch.deployments.cluster.channel import ActorOwner, owner_is_dead
from fairbatch.deployments.cluster.controller import Controller
from fairbatch.deployments.cluster.fairness import ControllerConfig
from fairbatch.deployments.cluster.limits import LimitsSpec, TenantLimit
from fairbatch.deployments.cluster.replica import Replica, ReplicaConfig
from fairbatch.deployments.cluster.replica_set import ReplicaSet, ReplicaSpec
from fairbatch.deployments.metrics import Deltas, get_metrics, record_host_tier
from fairbatch.policies import TenantSpec

log = logging.getLogger(__name__)

UPDATE_TIMEOUT_S = 15.0  # tenant pushes to each replica, liveness pings of ingresses


def _spawn(coro: Any, tasks: set) -> None:
    task = asyncio.get_running_loop().create_task(coro)
    tasks.add(task)
    task.add_done_callback(tasks.discard)


# ---- actors -----------------------------------------------------------------------------------


class ClusterController(Controller):
    """The controller plus: tenant updates (admin changes kept in `changes`, admin_store.py),
    ingress attach counting, periodic metrics. It owns the replicas (`ensure_replicas`,
    replacement of dead ones); the last ingress to detach stops them."""

    def __init__(
        self,
        config: ControllerConfig,
        metrics_interval_s: float = 1.0,
        replicas: ReplicaSet | None = None,
        changes: AdminChanges | None = None,
    ) -> None:
        super().__init__(config, replicas)
        self.users: dict[str, ActorOwner | None] = {}  # attached ingress -> its actor
        self.metrics_interval_s = metrics_interval_s
        self._metrics_task: asyncio.Task | None = None
        self._tenant_updates: dict[str, tuple[float, int]] = {}  # for replacement replicas
        # the tenants the app's config names (None: not told); the only ones exported, so a
        # tenant removed from the config stops being exported
        self.served_tenants: frozenset[str] | None = None
        self.changes = changes or AdminChanges(None, "")
        for name, s in self.changes.load().tenants.items():  # as they were before a restart
            self._apply_tenant(
                name, s.weight, s.priority, TenantLimit(s.tokens_per_minute, s.max_requests)
            )

    async def attach(self, user: str, owner: ActorOwner | None = None) -> int:
        """Count an ingress in. With its actor (`owner`), an ingress that dies without
        detaching (killed) stops counting at the next detach."""
        self.users[user] = owner
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
        users = [(u, o) for u, o in self.users.items() if o is not None]
        verdicts = await asyncio.gather(*(owner_is_dead(o, UPDATE_TIMEOUT_S) for _, o in users))
        for (user, _), is_dead in zip(users, verdicts):
            if is_dead:
                log.info("ingress %s died without detaching: no longer counted", user)
                self.users.pop(user, None)

    async def set_tenants(self, names: list[str]) -> None:
        """The tenants the attaching ingress's config names: the ones exported from now on."""
        self.served_tenants = frozenset(names)

    def exported(self, values: dict[str, float]) -> dict[str, float]:
        """Per-tenant values, of the served tenants only."""
        served = self.served_tenants
        return values if served is None else {k: v for k, v in values.items() if k in served}

    async def set_limits(self, spec: LimitsSpec) -> None:
        """The tenants' quotas and bounds as the attaching ingress's config has them; admin
        changes win over it."""
        self.core.set_limits(spec)
        for name, s in self.changes.now.tenants.items():
            self.core.limits.set_tenant(name, TenantLimit(s.tokens_per_minute, s.max_requests))

    async def update_tenant(
        self,
        name: str,
        weight: float,
        priority: int,
        limit: TenantLimit | None = None,
        change: bool = False,
    ) -> None:
        """The global queue's tenant, and (in the background) every replica's in service; a
        replacement starts with it (`_replica_config`). `limit`: its cluster-wide quota and
        in-flight bound, where the controller enforces limits. `change`: an admin's change,
        kept (it outlives restarts and wins over configs); else an ingress's config, which
        gives way to a kept change."""
        if change:
            limit = limit or TenantLimit()
            settings = TenantSettings(weight, priority, limit.tokens_per_minute, limit.max_requests)
            self.changes.set_tenant(name, settings)
        elif name in self.changes.now.tenants:
            return
        self._apply_tenant(name, weight, priority, limit)
        self._apply(self.core.dispatch())
        update = {name: (weight, priority)}
        _spawn(self._push_tenants(list(self.handles.values()), update), self._tasks)

    def _apply_tenant(
        self, name: str, weight: float, priority: int, limit: TenantLimit | None
    ) -> None:
        if limit is not None and self.core.limits is not None:
            self.core.limits.set_tenant(name, limit)
        self._tenant_updates[name] = (weight, priority)
        self.core.policy.update_tenant(name, weight=weight, priority=priority)

    async def admin_changes(self, version: int = 0) -> Changes | None:
        """The admin's changes (tenants, LoRA adapters) if newer than `version`."""
        return self.changes.since(version)

    async def change_lora(self, name: str, settings: LoRASettings | None) -> int:
        """An adapter loaded (`settings`) or unloaded (None) through an ingress: kept, and
        picked up by every other ingress."""
        return self.changes.set_lora(name, settings)

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
                # (a series no longer set ages out of Ray's metrics agent)
                for tenant, value in self.exported(core.counters()).items():
                    m.tenant_counter.set(value, tags={"tenant": tenant})
                for tenant, value in self.exported(core.policy.service()).items():
                    m.tenant_service.set(value, tags={"tenant": tenant})
                deltas.inc(m.migrations, core.num_migrations, {})
                for tenant, n in self.exported(core.timed_out).items():
                    deltas.inc(m.timed_out, n, {"tenant": tenant, "stage": "queue"})
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
            "timed_out": dict(self.core.timed_out),
            "host_tier": self.core.stats()["host_tier"],
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
                for (tenant, stage), n in snap["timed_out"].items():
                    deltas.inc(m.timed_out, n, {"tenant": tenant, "stage": stage})
                record_host_tier(m, deltas, snap["host_tier"], tag)
            except Exception as e:
                log.debug("replica metrics failed: %r", e)
            await asyncio.sleep(self.metrics_interval_s)
