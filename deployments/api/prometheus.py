"""GET /metrics: the API's own metrics and the engines' state, in Prometheus text format.

The names are those of the Ray metrics in `fairbatch.deployments.metrics` (without Ray's `ray_`
prefix), summed over replicas, so there is no `replica` label here:

* recorded by this app as requests end (the ingress sees them): `fairbatch_requests_total`
  {tenant, finish_reason}, `fairbatch_requests_timed_out_total` {tenant, stage = queue (no
  token yet) | running}, `fairbatch_tokens_total` {tenant, kind = prompt | completion},
  `fairbatch_ttft_seconds` {tenant}, `fairbatch_tpot_seconds` {tenant},
  `fairbatch_e2e_latency_seconds` {tenant, finish_reason};
* read at scrape time: `fairbatch_rejections_total` {tenant} (the tenant registry), and from
  the backend's optional `stats()`: `fairbatch_queue_depth`, `fairbatch_running_seqs`,
  `fairbatch_swapped_seqs`, `fairbatch_kv_usage_ratio` (mean over replicas),
  `fairbatch_preemptions_total` {mode}, `fairbatch_swapped_bytes_total` {direction},
  `fairbatch_prefix_hit_tokens_total`, the host tier's `fairbatch_host_tier_cached_blocks`,
  `fairbatch_host_tier_capacity_blocks`, `fairbatch_host_tier_hit_tokens_total`,
  `fairbatch_host_tier_block_events_total` {event = stored | loaded | evicted},
  `fairbatch_tenant_service_tokens` {tenant},
  `fairbatch_tenant_virtual_counter` {tenant}, and on a cluster `fairbatch_migrations_total`.

`finish_reason` is the engine's ("stop", "length", "timeout", "abort", "error") or
"client_gone" for a request whose client left first. Each app has its own `CollectorRegistry`
(never the global one), so many apps can live in one process.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics import Counter, Histogram

from fairbatch.deployments.api.http import maybe_await
from fairbatch.deployments.metrics import LATENCY_BOUNDS, TPOT_BOUNDS

log = logging.getLogger("fairbatch.api")


class ApiMetrics:
    """The per-request metrics one app records (`started`, `first_token`, `finished`)."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self.clock = clock
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.requests = Counter(
            "fairbatch_requests_total",
            "Requests that ended, by how they ended.",
            ("tenant", "finish_reason"),
            registry=reg,
        )
        self.timed_out = Counter(
            "fairbatch_requests_timed_out_total",
            "Requests that ended past their deadline, by stage (queue: before a token).",
            ("tenant", "stage"),
            registry=reg,
        )
        self.tokens = Counter(
            "fairbatch_tokens_total",
            "Prompt and completion tokens served.",
            ("tenant", "kind"),
            registry=reg,
        )
        self.ttft = Histogram(
            "fairbatch_ttft_seconds",
            "Time from submission to the first token, queueing included.",
            ("tenant",),
            registry=reg,
            buckets=LATENCY_BOUNDS,
        )
        self.tpot = Histogram(
            "fairbatch_tpot_seconds",
            "Mean time per output token after the first, per request.",
            ("tenant",),
            registry=reg,
            buckets=TPOT_BOUNDS,
        )
        self.e2e = Histogram(
            "fairbatch_e2e_latency_seconds",
            "Time from submission to the last token.",
            ("tenant", "finish_reason"),
            registry=reg,
            buckets=LATENCY_BOUNDS,
        )

    # Timestamps live in the ticket's `meta`; a request that never passed `started` (the
    # handle API) is counted without latencies.

    def started(self, ticket: Any) -> None:
        ticket.meta["t_start"] = self.clock()

    def first_token(self, ticket: Any, delta: Any) -> None:
        if delta.token_ids:
            ticket.meta["t_first"] = self.clock()

    def finished(self, ticket: Any, outcome: str) -> None:
        """Record a request that ended; `outcome` as `finish_log` gets it ("ok" = finished
        normally, its reason is then the ticket's)."""
        if ticket.meta.get("t_done"):
            return  # counted once, whatever path ends it
        ticket.meta["t_done"] = True
        tenant = ticket.tenant.name
        reason = (ticket.finish_reason or "stop") if outcome == "ok" else outcome
        self.requests.labels(tenant, reason).inc()
        if reason == "timeout":
            stage = "running" if ticket.completion_tokens else "queue"
            self.timed_out.labels(tenant, stage).inc()
        self.tokens.labels(tenant, "prompt").inc(ticket.prompt_tokens)
        self.tokens.labels(tenant, "completion").inc(ticket.completion_tokens)
        start = ticket.meta.get("t_start")
        if start is None:
            return
        now = self.clock()
        self.e2e.labels(tenant, reason).observe(now - start)
        first = ticket.meta.get("t_first")
        if first is not None:
            self.ttft.labels(tenant).observe(first - start)
            if ticket.completion_tokens > 1:
                tpot = (now - first) / (ticket.completion_tokens - 1)
                self.tpot.labels(tenant).observe(tpot)


class _Snapshot:
    """A collector over values read once (the tenant registry, the backend's stats())."""

    def __init__(self, registry: Any, engine: dict | None) -> None:
        self.registry = registry
        self.engine = engine

    def collect(self):
        rej = CounterMetricFamily(
            "fairbatch_rejections",
            "Requests refused at admission (quota, tenant or global bound).",
            labels=["tenant"],
        )
        for t in self.registry.tenants.values():
            rej.add_metric([t.name], t.requests_rejected)
        yield rej
        if self.engine is not None:
            yield from engine_families(self.engine)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def engine_families(s: dict):
    """Metric families from `EngineCore.stats()` keys (summed over replicas); a cluster's
    stats also carry the controller's global queue, counters and service."""
    ctl = s.get("controller") or {}
    yield _gauge(
        "fairbatch_queue_depth",
        "Requests waiting: in the replicas' queues and the controller's global queue.",
        s.get("waiting", 0) + ctl.get("queued", 0),
    )
    yield _gauge("fairbatch_running_seqs", "Sequences running.", s.get("running", 0))
    yield _gauge(
        "fairbatch_swapped_seqs", "Sequences swapped out to CPU memory.", s.get("swapped", 0)
    )
    yield _gauge(
        "fairbatch_kv_usage_ratio",
        "Fraction of the KV blocks in use (mean over replicas).",
        s.get("kv_usage", 0.0),
    )
    pre = CounterMetricFamily(
        "fairbatch_preemptions", "Preemptions, by mode (swap or recompute).", labels=["mode"]
    )
    for mode, n in sorted(s.get("preemptions", {}).items()):
        pre.add_metric([mode], n)
    yield pre
    swap = CounterMetricFamily(
        "fairbatch_swapped_bytes",
        "KV bytes copied between device and CPU memory.",
        labels=["direction"],
    )
    for direction, n in sorted(s.get("swapped_bytes", {}).items()):
        swap.add_metric([direction], n)
    yield swap
    yield CounterMetricFamily(
        "fairbatch_prefix_hit_tokens",
        "Prompt tokens found in the prefix cache.",
        value=s.get("prefix_hit_tokens", 0),
    )
    tier = s.get("host_tier")
    if tier is not None:
        yield _gauge(
            "fairbatch_host_tier_cached_blocks",
            "Prefix blocks held in the host-memory tier.",
            tier.get("cached_blocks", 0),
        )
        yield _gauge(
            "fairbatch_host_tier_capacity_blocks",
            "Host-memory KV blocks (the tier and swap share them); 0 without a tier.",
            tier.get("capacity_blocks", 0),
        )
        yield CounterMetricFamily(
            "fairbatch_host_tier_hit_tokens",
            "Prompt tokens loaded from the host tier instead of computed.",
            value=tier.get("hit_tokens", 0),
        )
        events = CounterMetricFamily(
            "fairbatch_host_tier_block_events",
            "Host-tier blocks stored (evicted from the device), loaded back, evicted.",
            labels=["event"],
        )
        for event in ("stored", "loaded", "evicted"):
            events.add_metric([event], tier.get(f"{event}_blocks", 0))
        yield events
    # The cluster's tenant accounting is the controller's; a single engine's is its policy's.
    service = ctl.get("service", s.get("tenant_service", {}))
    counters = ctl.get("counters", s.get("tenant_counters", {}))
    yield _per_tenant(
        "fairbatch_tenant_service_tokens", "Weighted tokens served to the tenant.", service
    )
    yield _per_tenant(
        "fairbatch_tenant_virtual_counter",
        "The tenant's virtual token counter (weighted service / weight).",
        counters,
    )
    if "migrations" in ctl:
        yield CounterMetricFamily(
            "fairbatch_migrations", "Requests moved between replicas.", value=ctl["migrations"]
        )


class _Both:
    def __init__(self, *collectors: Any) -> None:
        self.collectors = collectors

    def collect(self):
        for c in self.collectors:
            yield from c.collect()


def add_metrics_route(app: FastAPI, api: Any) -> None:
    """GET /metrics on `app` unless `api.config.metrics.enabled` is off; admin-key-gated when
    `metrics.require_admin_key` is on."""
    cfg = api.config.metrics
    if not cfg.enabled:
        return

    async def metrics(request: Request) -> Response:
        if cfg.require_admin_key:
            api.require_admin(request)
        engine = None
        get = getattr(api.backend, "stats", None)
        if get is not None:
            try:
                engine = await maybe_await(get())
            except Exception:  # the ingress' own metrics are still worth serving
                log.warning("backend stats failed; /metrics without engine state", exc_info=True)
        body = generate_latest(_Both(api.metrics.registry, _Snapshot(api.registry, engine)))
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    app.add_api_route("/metrics", metrics, methods=["GET"], include_in_schema=False)


def _per_tenant(name: str, doc: str, values: dict) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["tenant"])
    for tenant, value in sorted(values.items()):
        family.add_metric([tenant], value)
    return family
