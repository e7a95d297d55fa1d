"""fairbatch's metrics, through `ray.util.metrics` (Prometheus names get Ray's `ray_` prefix).

Each process that records metrics (the ingress, the controller, every replica) calls
`get_metrics()` once: the metric objects are made lazily because `ray.util.metrics` needs a
connected Ray worker. Tags are tenant names, replica ids, modes and reasons: never keys, never
prompt or completion text.

| metric (as exported) | type | tags | from |
|---|---|---|---|
| ray_fairbatch_ttft_seconds | histogram | tenant, replica | ingress |
| ray_fairbatch_tpot_seconds | histogram | tenant, replica | ingress |
| ray_fairbatch_e2e_latency_seconds | histogram | tenant, finish_reason | ingress |
| ray_fairbatch_requests_total | counter | tenant, finish_reason | ingress |
| ray_fairbatch_requests_timed_out_total | counter | tenant, stage (queue, running) | both |
| ray_fairbatch_tokens_total | counter | tenant, kind | ingress |
| ray_fairbatch_rejections_total | counter | tenant | ingress |
| ray_fairbatch_queue_depth | gauge | replica ("controller") | both |
| ray_fairbatch_running_seqs | gauge | replica | replica |
| ray_fairbatch_swapped_seqs | gauge | replica | replica |
| ray_fairbatch_kv_usage_ratio | gauge | replica | replica |
| ray_fairbatch_preemptions_total | counter | replica, mode | replica |
| ray_fairbatch_swapped_bytes_total | counter | replica, direction | replica |
| ray_fairbatch_host_tier_cached_blocks | gauge | replica | replica |
| ray_fairbatch_host_tier_hit_tokens_total | counter | replica | replica |
| ray_fairbatch_host_tier_block_events_total | counter | replica, event | replica |
| ray_fairbatch_migrations_total | counter | - | controller |
| ray_fairbatch_tenant_virtual_counter | gauge | tenant | controller |
| ray_fairbatch_tenant_service_tokens | gauge | tenant | controller |
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

# Seconds. TTFT spans queueing (tens of seconds under overload); TPOT is per output token.
LATENCY_BOUNDS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]
TPOT_BOUNDS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]


@dataclass
class Metrics:
    ttft: Any
    tpot: Any
    e2e: Any
    requests: Any
    timed_out: Any
    tokens: Any
    rejections: Any
    queue_depth: Any
    running: Any
    swapped: Any
    kv_usage: Any
    preemptions: Any
    swapped_bytes: Any
    host_tier_blocks: Any
    host_tier_hits: Any
    host_tier_events: Any
    migrations: Any
    tenant_counter: Any
    tenant_service: Any


_lock = threading.Lock()
_metrics: Metrics | None = None


def get_metrics() -> Metrics:
    """This process's metric objects (made on first use; needs a connected Ray worker)."""
    global _metrics
    with _lock:
        if _metrics is None:
            _metrics = _make()
        return _metrics


def _make() -> Metrics:
    from ray.util.metrics import Counter, Gauge, Histogram

    def hist(name: str, desc: str, bounds: list[float], tags: tuple[str, ...]) -> Any:
        return Histogram(name, description=desc, boundaries=bounds, tag_keys=tags)

    return Metrics(
        ttft=hist(
            "fairbatch_ttft_seconds",
            "Time from submission to the first token, queueing included.",
            LATENCY_BOUNDS,
            ("tenant", "replica"),
        ),
        tpot=hist(
            "fairbatch_tpot_seconds",
            "Mean time per output token after the first, per request.",
            TPOT_BOUNDS,
            ("tenant", "replica"),
        ),
        e2e=hist(
            "fairbatch_e2e_latency_seconds",
            "Time from submission to the last token.",
            LATENCY_BOUNDS,
            ("tenant", "finish_reason"),
        ),
        requests=Counter(
            "fairbatch_requests_total",
            description="Requests that ended, by how they ended.",
            tag_keys=("tenant", "finish_reason"),
        ),
        timed_out=Counter(
            "fairbatch_requests_timed_out_total",
            description="Requests ended past their deadline, by stage (queue: before a token).",
            tag_keys=("tenant", "stage"),
        ),
        tokens=Counter(
            "fairbatch_tokens_total",
            description="Prompt and completion tokens served.",
            tag_keys=("tenant", "kind"),
        ),
        rejections=Counter(
            "fairbatch_rejections_total",
            description="Requests refused at admission (quota, tenant or global bound).",
            tag_keys=("tenant",),
        ),
        queue_depth=Gauge(
            "fairbatch_queue_depth",
            description="Requests waiting: in the controller's global queue, or a replica's.",
            tag_keys=("replica",),
        ),
        running=Gauge(
            "fairbatch_running_seqs", description="Sequences running.", tag_keys=("replica",)
        ),
        swapped=Gauge(
            "fairbatch_swapped_seqs",
            description="Sequences swapped out to CPU memory.",
            tag_keys=("replica",),
        ),
        kv_usage=Gauge(
            "fairbatch_kv_usage_ratio",
            description="Fraction of the replica's KV blocks in use.",
            tag_keys=("replica",),
        ),
        preemptions=Counter(
            "fairbatch_preemptions_total",
            description="Preemptions, by mode (swap or recompute).",
            tag_keys=("replica", "mode"),
        ),
        swapped_bytes=Counter(
            "fairbatch_swapped_bytes_total",
            description="KV bytes copied between device and CPU memory.",
            tag_keys=("replica", "direction"),
        ),
        host_tier_blocks=Gauge(
            "fairbatch_host_tier_cached_blocks",
            description="Prefix blocks held in the replica's host-memory tier.",
            tag_keys=("replica",),
        ),
        host_tier_hits=Counter(
            "fairbatch_host_tier_hit_tokens_total",
            description="Prompt tokens loaded from the host tier instead of computed.",
            tag_keys=("replica",),
        ),
        host_tier_events=Counter(
            "fairbatch_host_tier_block_events_total",
            description="Host-tier blocks stored (evicted from the device), loaded, evicted.",
            tag_keys=("replica", "event"),
        ),
        migrations=Counter(
            "fairbatch_migrations_total", description="Requests moved between replicas."
        ),
        tenant_counter=Gauge(
            "fairbatch_tenant_virtual_counter",
            description="The tenant's cluster-wide virtual token counter (weighted service).",
            tag_keys=("tenant",),
        ),
        tenant_service=Gauge(
            "fairbatch_tenant_service_tokens",
            description="Weighted tokens served to the tenant, cluster-wide.",
            tag_keys=("tenant",),
        ),
    )


def record_host_tier(metrics: Metrics, deltas: Deltas, tier: dict, tags: dict) -> None:
    """A replica's host-tier numbers (`EngineCore.stats()["host_tier"]`) into its metrics."""
    metrics.host_tier_blocks.set(tier["cached_blocks"], tags=tags)
    deltas.inc(metrics.host_tier_hits, tier["hit_tokens"], tags)
    for event in ("stored", "loaded", "evicted"):
        deltas.inc(metrics.host_tier_events, tier[f"{event}_blocks"], {**tags, "event": event})


class Deltas:
    """Turns cumulative numbers (a scheduler's counts) into counter increments."""

    def __init__(self) -> None:
        self._last: dict[tuple, float] = {}

    def inc(self, counter: Any, value: float, tags: dict[str, str]) -> None:
        key = (id(counter), *sorted(tags.items()))
        delta = value - self._last.get(key, 0.0)
        self._last[key] = value
        if delta > 0:
            counter.inc(delta, tags=tags)


class RequestTimer:
    """TTFT, TPOT and end-to-end latency of one request, recorded when it ends."""

    def __init__(self, tenant: str, clock: Any) -> None:
        self.tenant = tenant
        self.clock = clock
        self.start = clock()
        self.first: float | None = None
        self.last = self.start
        self.tokens = 0
        self.replica = ""

    def tokens_out(self, n: int, replica: str) -> None:
        if n <= 0:
            return
        now = self.clock()
        if self.first is None:
            self.first = now
            self.replica = replica or self.replica
        self.last = now
        self.tokens += n

    def record(self, metrics: Metrics, finish_reason: str, prompt_tokens: int) -> None:
        tenant = self.tenant
        rep = self.replica or "none"
        if self.first is not None:
            metrics.ttft.observe(self.first - self.start, tags={"tenant": tenant, "replica": rep})
            if self.tokens > 1:
                tpot = (self.last - self.first) / (self.tokens - 1)
                metrics.tpot.observe(tpot, tags={"tenant": tenant, "replica": rep})
        end = self.clock()
        metrics.e2e.observe(
            end - self.start, tags={"tenant": tenant, "finish_reason": finish_reason}
        )
        metrics.requests.inc(1, tags={"tenant": tenant, "finish_reason": finish_reason})
        if prompt_tokens:
            metrics.tokens.inc(prompt_tokens, tags={"tenant": tenant, "kind": "prompt"})
        if self.tokens:
            metrics.tokens.inc(self.tokens, tags={"tenant": tenant, "kind": "completion"})
