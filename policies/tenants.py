"""The tenant registry of a `Policy`: tenant specs, registration order, token-bucket quotas.

`TenantRegistry` is a part of `Policy` (policies/base.py), not a class on its own: it reads the
policy's orders and marks its queue stale when a tenant's quota eligibility changes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import EllipsisType

from .quota import TokenBucket

_NEVER = math.inf


@dataclass(frozen=True)
class TenantSpec:
    """A tenant's configuration. Frozen: change it through `Policy.update_tenant`."""

    name: str
    weight: float = 1.0  # > 0, share in weighted_fair
    priority: int = 0  # informational default class (requests carry their own .priority)
    tokens_per_minute: float | None = None  # token-bucket quota; None = unlimited
    # fraction of each replica's GPU blocks kept for this tenant (kv/block_pool.py); None: none
    kv_share: float | None = None

    def __post_init__(self) -> None:
        share = self.kv_share
        if share is not None and not (isinstance(share, (int, float)) and 0 < share <= 1):
            raise ValueError(f"tenant {self.name!r}: kv_share must be in (0, 1], got {share!r}")
        if not self.weight > 0:
            raise ValueError(f"tenant {self.name!r}: weight must be > 0, got {self.weight}")
        if self.tokens_per_minute is not None and not self.tokens_per_minute > 0:
            raise ValueError(
                f"tenant {self.name!r}: tokens_per_minute must be > 0 or None, "
                f"got {self.tokens_per_minute}"
            )


class TenantRegistry:
    """Registered tenants and their quotas (the `Policy` methods on tenants)."""

    def _init_registry(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._specs: dict[str, TenantSpec] = {}
        self._weights: dict[str, float] = {}  # name -> spec.weight (read per tenant per step)
        self._ring: dict[str, int] = {}  # registration number of each tenant (round robin)
        self._buckets: dict[str, TokenBucket] = {}
        self._throttled: set[str] = set()  # tenants with a bucket <= 0 as of the last check
        self._next_wake = _NEVER  # earliest time a throttled tenant may be eligible again

    def add_tenant(self, spec: TenantSpec) -> None:
        """Register `spec`, or replace the spec of a tenant with that name.

        Replacing keeps the tenant's counters, service and cycle position; a changed quota
        keeps the bucket's current level (capped at the new capacity).
        """
        name = spec.name
        if name not in self._specs:
            self._ring[name] = len(self._ring)
            self._open_account(name)
        else:
            self._settle(name)  # steps so far are charged at the old weight
        self._specs[name] = spec
        self._weights[name] = spec.weight
        self._set_quota(name, spec.tokens_per_minute)
        self._stale = True

    def update_tenant(
        self,
        name: str,
        *,
        weight: float | None = None,
        priority: int | None = None,
        tokens_per_minute: float | None | EllipsisType = ...,
    ) -> None:
        """Change some fields of a tenant (registering it if unknown).

        `tokens_per_minute=None` removes the quota; leaving it out (`...`) keeps it.
        A new weight applies to later charges only.
        """
        changes: dict[str, object] = {}
        if weight is not None:
            changes["weight"] = weight
        if priority is not None:
            changes["priority"] = priority
        if tokens_per_minute is not ...:
            changes["tokens_per_minute"] = tokens_per_minute
        self.add_tenant(replace(self.tenant(name), **changes))

    def tenant(self, name: str) -> TenantSpec:
        """The tenant's spec; an unknown tenant is registered with defaults."""
        spec = self._specs.get(name)
        if spec is None:
            spec = TenantSpec(name)
            self.add_tenant(spec)
        return spec

    def kv_shares(self) -> dict[str, float]:
        """Tenant -> its `kv_share`, for the tenants configured with one."""
        return {name: s.kv_share for name, s in self._specs.items() if s.kv_share is not None}

    # ---- quotas --------------------------------------------------------------------------

    def quota_eligible(self, tenant: str) -> bool:
        """True if the tenant has no quota or its bucket is > 0 now."""
        bucket = self._buckets.get(tenant)
        return bucket is None or bucket.level(self.clock()) > 0

    def retry_after(self, tenant: str) -> float:
        """Seconds until the tenant's bucket is positive again; 0.0 if eligible or no quota."""
        bucket = self._buckets.get(tenant)
        return 0.0 if bucket is None else bucket.retry_after(self.clock())

    def _consume(self, tenant: str, tokens: int) -> None:
        bucket = self._buckets.get(tenant)
        if bucket is not None:
            now = self.clock()
            level = bucket.consume(tokens, now)
            if level <= 0 and tenant not in self._throttled:
                self._throttle(tenant, bucket, now)

    def _set_quota(self, name: str, tokens_per_minute: float | None) -> None:
        bucket = self._buckets.get(name)
        now = self.clock()
        if tokens_per_minute is None:
            self._buckets.pop(name, None)
        elif bucket is None or bucket.capacity != tokens_per_minute:
            level = None if bucket is None else bucket.level(now)
            self._buckets[name] = TokenBucket(tokens_per_minute, now, level)
        bucket = self._buckets.get(name)
        eligible = bucket is None or bucket.level(now) > 0
        if eligible and name in self._throttled:
            self._unthrottle(name)
        elif not eligible and name not in self._throttled:
            assert bucket is not None
            self._throttle(name, bucket, now)

    def _throttle(self, name: str, bucket: TokenBucket, now: float) -> None:
        # Orders drop the tenant lazily (they test membership in _throttled).
        self._throttled.add(name)
        self._next_wake = min(self._next_wake, now + bucket.retry_after(now))
        self._stale = True

    def _unthrottle(self, name: str) -> None:
        self._throttled.discard(name)
        for order in self._all_orders():
            order.eligibility_changed(name)
        self._stale = True

    def _wake_throttled(self) -> None:
        """Move tenants whose buckets refilled out of the throttled set (cheap when none due)."""
        if not self._throttled:
            return
        now = self.clock()
        if now < self._next_wake:
            return
        self._next_wake = _NEVER
        for name in list(self._throttled):
            bucket = self._buckets[name]
            if bucket.level(now) > 0:
                self._unthrottle(name)
            else:
                self._next_wake = min(self._next_wake, now + bucket.retry_after(now))
