"""Tenants' quotas and in-flight bounds for the whole cluster, kept by the controller.

Every request of every ingress is submitted to the controller before it runs, and every
replica reports the tokens it produced per tenant (cumulatively, every report interval), so the
controller sees all of a tenant's traffic: its bucket and its in-flight count are the cluster's,
however many ingress replicas admit requests. An ingress still checks its own share first (the
same rule, `policies.quota.refusal`, over what it alone admitted): that can only refuse what
the cluster would refuse too, and it saves the hop for a tenant that is plainly over.

Charging: a request's prompt when it is admitted here, its output tokens as the replicas report
them. So the cluster admits past a quota by at most what a single server would (the output of
requests admitted while the bucket was still positive, charged as it is produced), plus the
output produced in one report interval. In-flight counts are exact at admission; a request that
ended is counted until its replica's next report.

A restarted controller starts with full buckets and counts the requests its replicas report.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from fairbatch.policies.quota import Rejected, TokenBucket, refusal


@dataclass(frozen=True)
class TenantLimit:
    tokens_per_minute: float | None = None  # None: no quota
    max_requests: int | None = None  # in flight; None: `LimitsSpec.max_requests_per_tenant`

    def __post_init__(self) -> None:
        if self.tokens_per_minute is not None and not self.tokens_per_minute > 0:
            raise ValueError(f"tokens_per_minute must be > 0, got {self.tokens_per_minute}")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {self.max_requests}")


@dataclass(frozen=True)
class LimitsSpec:
    """What the controller enforces: per-tenant limits (tenants not named have none but the
    defaults) and the bounds every tenant and the whole cluster share."""

    tenants: dict[str, TenantLimit] = field(default_factory=dict)
    max_requests_per_tenant: int = 1024
    max_requests_total: int = 4096
    retry_after_s: int = 1


class ClusterLimits:
    def __init__(self, spec: LimitsSpec, clock: Callable[[], float]) -> None:
        self.spec = spec
        self.clock = clock
        self.buckets: dict[str, TokenBucket] = {}
        self.max_requests: dict[str, int | None] = {}
        self.in_flight: Counter[str] = Counter()
        self.total = 0
        self.rejected: Counter[str] = Counter()
        for name, limit in spec.tenants.items():
            self.set_tenant(name, limit)

    def set_spec(self, spec: LimitsSpec) -> None:
        """New bounds and tenants' limits (an ingress attached with its config); counts and
        buckets' levels stay."""
        self.spec = spec
        for name, limit in spec.tenants.items():
            self.set_tenant(name, limit)

    def set_tenant(self, name: str, limit: TenantLimit) -> None:
        """Set a tenant's limits. A resized bucket keeps its level (debt included)."""
        old = self.buckets.pop(name, None)
        if limit.tokens_per_minute is not None:
            now = self.clock()
            level = None if old is None else old.level(now)
            self.buckets[name] = TokenBucket(limit.tokens_per_minute, now, level)
        self.max_requests[name] = limit.max_requests

    def limit(self, name: str) -> TenantLimit:
        bucket = self.buckets.get(name)
        return TenantLimit(
            None if bucket is None else bucket.capacity, self.max_requests.get(name)
        )  # fmt: skip

    def bound(self, name: str) -> int:
        own = self.max_requests.get(name) or self.spec.max_requests_per_tenant
        return min(own, self.spec.max_requests_total)

    def admit(self, tenant: str, prompt_tokens: int) -> Rejected | None:
        """Count the request in and charge its prompt, or return why it is refused."""
        refused = refusal(
            tenant, self.buckets.get(tenant), self.in_flight[tenant], self.bound(tenant),
            self.total, self.spec.max_requests_total, self.spec.retry_after_s, self.clock(),
        )  # fmt: skip
        if refused is not None:
            self.rejected[tenant] += 1
            return refused
        self.started(tenant)
        self.charge(tenant, prompt_tokens)
        return None

    def started(self, tenant: str) -> None:
        """Count in a request admitted before (resubmitted, or adopted after a restart)."""
        self.in_flight[tenant] += 1
        self.total += 1

    def ended(self, tenant: str) -> None:
        if self.in_flight[tenant] > 0:
            self.in_flight[tenant] -= 1
            self.total -= 1

    def charge(self, tenant: str, tokens: int) -> None:
        """Charge tokens (negative: a refund) to the tenant's bucket, if it has one."""
        bucket = self.buckets.get(tenant)
        if bucket is not None and tokens:
            bucket.consume(tokens, self.clock())
