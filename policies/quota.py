"""Per-tenant token-bucket quotas.

A bucket holds up to `tokens_per_minute` tokens and refills at `tokens_per_minute / 60` per
second. Charging may drive it negative (a step's tokens are charged after they were computed);
the tenant is eligible again once the debt has refilled and the level is strictly positive.
"""

from __future__ import annotations


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
