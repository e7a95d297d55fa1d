"""Per-tenant token-bucket quotas.

A bucket holds up to `tokens_per_minute` tokens and refills at `tokens_per_minute / 60` per
second. Charging may drive it negative (a step's tokens are charged after they were computed);
the tenant is eligible again once the debt has refilled and the level is strictly positive.
"""

from __future__ import annotations

import math


class TokenBucket:
    """A token bucket read and written at caller-supplied times (the policy's injected clock)."""

    __slots__ = ("capacity", "rate", "_level", "_stamp")

    def __init__(self, tokens_per_minute: float, now: float, level: float | None = None) -> None:
        if not tokens_per_minute > 0:
            raise ValueError(f"tokens_per_minute must be > 0, got {tokens_per_minute}")
        self.capacity = float(tokens_per_minute)
        self.rate = self.capacity / 60.0  # tokens per second
        # A new bucket starts full; a resized one keeps its level (debt included), capped.
        self._level = self.capacity if level is None else min(float(level), self.capacity)
        self._stamp = now

    def level(self, now: float) -> float:
        """Tokens available at `now` (negative in debt). A clock stepping back is ignored."""
        if now > self._stamp:
            self._level = min(self.capacity, self._level + (now - self._stamp) * self.rate)
            self._stamp = now
        return self._level

    def consume(self, tokens: float, now: float) -> float:
        """Deduct `tokens` (the level may go negative); returns the new level."""
        self._level = self.level(now) - tokens
        return self._level

    def retry_after(self, now: float) -> float:
        """Seconds from `now` until the level is positive again; 0.0 when it already is.

        At exactly the returned time the level is 0 (not yet eligible); any later instant it is
        positive. A level of exactly 0 therefore yields 0.0 although the bucket is not eligible.
        """
        level = self.level(now)
        return 0.0 if level > 0 else max(0.0, -level / self.rate)


class Rejected(Exception):
    """Admission refused: `status` 429 (a tenant's quota or in-flight bound) or 503 (the
    total bound), `code` naming which, with a Retry-After in whole seconds (>= 1)."""

    def __init__(self, status: int, code: str, message: str, retry_after: int) -> None:
        super().__init__(status, code, message, retry_after)  # args: it pickles across Ray
        self.status, self.code, self.message, self.retry_after = status, code, message, retry_after

    def __str__(self) -> str:
        return self.message


def refusal(
    tenant: str,
    bucket: TokenBucket | None,
    in_flight: int,
    bound: int,
    total_in_flight: int,
    total_bound: int,
    retry_after_s: int,
    now: float,
) -> Rejected | None:
    """The admission rule, for whoever sees every request of the tenants it admits (the
    ingress of one server; the controller of a cluster): over quota (an empty bucket) or at
    the tenant's in-flight `bound` -> 429, at `total_bound` -> 503; None admits."""
    if bucket is not None and bucket.level(now) <= 0:
        wait = max(1, math.ceil(bucket.retry_after(now)))
        return Rejected(
            429,
            "quota_exceeded",
            f"tenant {tenant!r} is over its quota of {bucket.capacity:g} tokens per minute; "
            f"retry in {wait} s",
            wait,
        )
    if in_flight >= bound:
        return Rejected(
            429,
            "tenant_queue_full",
            f"tenant {tenant!r} already has {in_flight} requests in flight (the limit is "
            f"{bound}); retry later",
            retry_after_s,
        )
    if total_in_flight >= total_bound:
        return Rejected(503, "server_busy", "the server is at capacity; retry later", retry_after_s)
    return None
