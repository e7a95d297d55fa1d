"""A replica's reports to the controller (`Replica` inherits `Reports`): a background task
sends one at a bounded rate (one per `report_interval_s` at most, and only when something
changed or a heartbeat is due), built between steps on the engine thread, and applies the
cluster-wide tenant counters the controller answers with. A lost report loses nothing: service
is cumulative and `finished` is resent until a report carrying it is delivered."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import ray

from fairbatch.deployments.cluster.placement import report_hashes
from fairbatch.deployments.cluster.wire import ReplicaReport

log = logging.getLogger(__name__)


class Reports:
    """Needs from the replica: `replica_id`, `config`, `core`, `engine`, `controller_name`,
    `namespace`, `_meta` (request id -> (tenant, priority, max_tokens) of all it holds),
    `_prune_exports` and `set_tenant_counters`."""

    def _init_reports(self) -> None:
        self._finished: list[tuple[str, int]] = []  # (id, output tokens) left since last report
        self._changed = True
        self._seq = 0
        self._hash_count = -1
        self._reporter: asyncio.Task | None = None
        self._controller: Any = None

    def _start_reporter(self) -> None:
        if self._reporter is None and self.controller_name is not None:
            self._reporter = asyncio.get_running_loop().create_task(self._report_loop())

    async def start(self) -> str:
        """Begin reporting (the cluster builder calls this once the actor is up)."""
        self._start_reporter()
        return self.replica_id

    async def _report_loop(self) -> None:
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
        num_host = len(kv.cpu_pool.cached)  # the host tier's (0 without one)
        running = {r.request_id for r in s.running}
        # not in the scheduler: ended (its last items on their way) or still being added;
        # reported as started, so that the controller does not move it as a waiting one
        held = s.requests
        num_out = self._num_out
        hashes = None
        if len(cached) + num_host != self._hash_count or self._seq % 25 == 0:
            self._hash_count = len(cached) + num_host
            hashes = report_hashes(list(cached)[-4096:], kv.host_cached_hashes()[-4096:])
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
            loras=None if s.loras is None else s.loras.pool.resident(),
            handle=handle,
        )

    def _num_out(self, rid: str) -> int:
        request = self.core.scheduler.requests.get(rid)
        return 0 if request is None else request.num_output_tokens
