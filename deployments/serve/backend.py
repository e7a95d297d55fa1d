"""`ClusterBackend`: the API's backend protocol (see `api.backend`) over the fairbatch cluster,
for the Serve ingress: `ClusterClient` streams, tenant updates through the controller, health
and the engines' counters summed over replicas.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fairbatch.deployments.cluster.admin_store import LoRASettings
from fairbatch.deployments.cluster.client import ClusterClient
from fairbatch.deployments.cluster.launch import ClusterHandles
from fairbatch.deployments.cluster.limits import TenantLimit
from fairbatch.deployments.metrics import RequestTimer, get_metrics
from fairbatch.engine.outputs import RequestDelta
from fairbatch.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

UPDATE_TIMEOUT_S = 15.0  # tenant pushes and stats through the controller
HEALTH_TIMEOUT_S = 5.0


class ClusterBackend:
    """The API's backend protocol (see `openai_api`) over `ClusterClient`, plus metrics."""

    def __init__(
        self,
        handles: ClusterHandles,
        tokenizer: Any,
        max_model_len: int,
        *,
        block_size: int = 16,
        salt_rule: Callable[[int, str], str] | None = None,  # ClusterClient's
        admit_timeout_s: float = 120.0,
        item_timeout_s: float = 120.0,
        admission_timeout_s: float = 30.0,
        record_metrics: bool = True,
    ) -> None:
        self.handles = handles
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.client = ClusterClient(
            handles.controller,
            block_size=block_size,
            salt_rule=salt_rule,
            admit_timeout_s=admit_timeout_s,
            item_timeout_s=item_timeout_s,
            admission_timeout_s=admission_timeout_s,
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
        fork_of: str | None = None,  # a sibling sample: to its parent's replica, if room
    ) -> AsyncIterator[RequestDelta]:
        timer = RequestTimer(tenant, time.monotonic)
        inner = self.client.generate(
            list(prompt_token_ids),
            params,
            tenant=tenant,
            priority=priority,
            request_id=request_id,
            cache_salt=cache_salt,  # None: salted with the tenant (replicas and affinity)
            fork_of=fork_of,
        )
        reason = "abort"
        try:
            async for item in inner:
                timer.tokens_out(len(item.token_ids), item.replica_id)
                if item.error:
                    log.warning("request_id=%s failed in the cluster: %s", request_id, item.error)
                yield item
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
        self,
        name: str,
        weight: float,
        priority: int,
        tokens_per_minute: float | None,
        max_requests: int | None,
        change: bool = False,
    ) -> None:
        # The controller enforces the limits over every ingress (cluster/limits.py) and keeps
        # share and class (a replacement replica starts with them), pushing those to every
        # replica in service, so no handle here can be stale. An admin's `change` it keeps
        # across restarts, and every ingress picks it up (admin_store.py).
        limit = TenantLimit(tokens_per_minute, max_requests)
        await asyncio.wait_for(
            self.handles.controller.update_tenant.remote(name, weight, priority, limit, change),
            timeout=UPDATE_TIMEOUT_S,
        )

    async def check_lora(self, lora: Any) -> None:
        """Every replica in service reads and validates the adapter (requests for it may go
        to any of them): a ValueError with the first one's reason if one cannot serve it."""

        async def check() -> list[str | None]:
            handles = await self.handles.controller.replica_handles.remote()
            return await asyncio.gather(*(h.check_lora.remote(lora) for h in handles.values()))

        for error in await asyncio.wait_for(check(), UPDATE_TIMEOUT_S):
            if error is not None:
                raise ValueError(error)

    async def lora_changed(self, name: str, lora: Any, tenants: frozenset[str] | None) -> None:
        """The controller keeps the load (or unload, `lora` None) for every ingress and for
        restarts (admin_store.py)."""
        settings = None
        if lora is not None:
            who = None if tenants is None else tuple(sorted(tenants))
            settings = LoRASettings(lora.name, lora.path, who)
        await asyncio.wait_for(
            self.handles.controller.change_lora.remote(name, settings), UPDATE_TIMEOUT_S
        )

    async def remove_lora(self, lora: Any) -> None:
        """Every replica in service drops the adapter once its requests under it have ended
        (a replica started later never reads it)."""

        async def remove() -> None:
            handles = await self.handles.controller.replica_handles.remote()
            await asyncio.gather(*(h.remove_lora.remote(lora.name) for h in handles.values()))

        await asyncio.wait_for(remove(), UPDATE_TIMEOUT_S)

    def record_usage(self, records: list[Any]) -> None:
        """To the usage log the controller keeps for every ingress (usage_ledger.py), encoded
        here (the ingresses share that work, not the one controller)."""
        self.client.record_usage([(r.request_id, r.to_json()) for r in records])

    async def usage_summary(self, tenant: str | None, since: float, until: float) -> dict:
        return await asyncio.wait_for(
            self.handles.controller.usage_summary.remote(tenant, since, until), UPDATE_TIMEOUT_S
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
