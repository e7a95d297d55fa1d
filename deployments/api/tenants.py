"""Ingress-side tenant state: who a key belongs to, quotas, in-flight bounds, request owners.

`TenantRegistry` answers, for every request, in this order:
  1. `authenticate(authorization header)` -> tenant, or AuthError (401).
  2. `admit(tenant, request_id, prompt_tokens)` -> a `Admission`, or Rejected (429 over quota or
     over the tenant's in-flight bound; 503 over the global bound), each with a Retry-After.
  3. `ticket.charge(n)` as completion tokens come out; `release(ticket)` when it ends.

Quotas are token buckets (`fairbatch.policies.quota.TokenBucket`): a tenant is admitted while
its bucket is positive; the prompt is charged at admission and every completion token as it is
produced, so a bucket may go into debt and Retry-After says when the debt will have refilled.

Keys are compared as sha256 digests with `hmac.compare_digest` against every configured digest
(no early exit), so neither timing nor a dict lookup tells which prefix matched. All methods
run on the event loop thread: no locks.
"""

from __future__ import annotations

import copy
import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fairbatch.deployments.api.config import AppConfig, TenantConfig, sha256_hex
from fairbatch.policies.quota import Rejected, TokenBucket, refusal

__all__ = ["Admission", "AuthError", "Rejected", "TenantRegistry", "TenantState"]

# Bearer tokens that OpenAI-compatible clients send when they have no key: anonymous.
NO_KEY_TOKENS = frozenset({"", "EMPTY", "none", "None"})


class AuthError(Exception):
    """Missing or unknown API key (401)."""


@dataclass
class TenantState:
    """A tenant's live settings and counters (the admin API changes the settings)."""

    name: str
    weight: float = 1.0
    priority: int = 0
    tokens_per_minute: float | None = None
    max_requests: int | None = None
    prefix_cache_group: str | None = None  # tenants of one group share prefix-cache blocks
    # (timeout, max_queue_time_s) of requests that set none, in seconds (None: no deadline)
    deadlines: tuple[float | None, float | None] = (None, None)
    key_digest: str | None = field(default=None, repr=False)
    bucket: TokenBucket | None = field(default=None, repr=False)
    in_flight: int = 0
    tokens_charged: int = 0  # prompt + completion tokens since start
    requests_admitted: int = 0
    requests_rejected: int = 0

    @property
    def cache_salt(self) -> str | None:
        """The prefix-cache salt for this tenant's requests: the group's, or None (the engine
        then salts with the tenant name). ":" is not allowed in names, so a group's salt never
        equals a tenant's."""
        group = self.prefix_cache_group
        return None if group is None else f"group:{group}"

    def public(self) -> dict:
        """What the admin API shows: settings and counters, never the key or its digest."""
        return {
            "name": self.name,
            "weight": self.weight,
            "priority": self.priority,
            "tokens_per_minute": self.tokens_per_minute,
            "max_requests": self.max_requests,
            "prefix_cache_group": self.prefix_cache_group,
            "in_flight": self.in_flight,
            "tokens_charged": self.tokens_charged,
            "requests_admitted": self.requests_admitted,
            "requests_rejected": self.requests_rejected,
        }


@dataclass(frozen=True)
class TenantSettings:
    """What the admin API can change on a tenant, saved so that a refused update can be undone
    completely: the settings and the quota bucket (its object, so its level and debt), plus the
    tokens charged when it was saved (charges made while the update was pending move to the
    restored bucket)."""

    name: str
    weight: float
    priority: int
    tokens_per_minute: float | None
    max_requests: int | None
    bucket: TokenBucket | None
    tokens_charged: int


@dataclass
class Admission:
    """One admitted request: its owner, and what it has been charged."""

    request_id: str
    tenant: TenantState
    registry: TenantRegistry
    created: int  # unix seconds
    prompt_tokens: int
    completion_tokens: int = 0
    finished: bool = False
    finish_reason: str | None = None
    cancelled: bool = False
    meta: dict = field(default_factory=dict)
    # For its usage record (deployments/usage.py): the model id it named, the response it
    # belongs to, times (Unix seconds) and what the backend said about where it ran
    model: str = ""
    response_id: str = ""
    arrival: float = field(default_factory=time.time)
    first_token: float | None = None
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    replica: str | None = None
    preemptions: int = 0
    moves: int = 0

    def observe(self, delta: Any) -> None:
        """Take in one backend delta: its tokens charged, its facts for the usage record."""
        if delta.token_ids and self.first_token is None:
            self.first_token = time.time()
        self.charge(len(delta.token_ids))
        cached = getattr(delta, "num_cached_tokens", None)  # the first delta's, once
        if cached and not self.cached_tokens:
            self.cached_tokens = cached
        replica = getattr(delta, "replica_id", None)
        if replica:
            self.replica = replica
        if delta.finished:
            self.finished = True
            self.finish_reason = delta.finish_reason
            self.preemptions = getattr(delta, "num_preemptions", None) or 0
            self.moves = getattr(delta, "num_moves", None) or 0

    def charge(self, completion_tokens: int) -> None:
        """Charge newly produced completion tokens to the tenant's bucket."""
        if completion_tokens <= 0:
            return
        self.completion_tokens += completion_tokens
        self.registry._charge(self.tenant, completion_tokens)


class TenantRegistry:
    def __init__(
        self, config: AppConfig, clock: Callable[[], float] = time.monotonic, enforce: bool = True
    ) -> None:
        """`enforce` False: quotas and in-flight bounds are the backend's to enforce (over
        every ingress); admission here only counts and charges."""
        self._clock = clock
        self.enforce = enforce
        self.limits = config.limits
        self.allow_anonymous = config.allow_anonymous
        self.anonymous = config.anonymous_tenant
        self._admin_digest = config.admin_api_key_sha256
        self.tenants: dict[str, TenantState] = {}
        for t in config.tenants:
            self._add(t)
        if self.allow_anonymous and self.anonymous not in self.tenants:
            self._add(TenantConfig(name=self.anonymous))
        self._keyed = [t for t in self.tenants.values() if t.key_digest is not None]
        self.requests: dict[str, Admission] = {}  # in flight, by request id
        self.total_in_flight = 0
        self.rejected_total = 0

    def _add(self, t: TenantConfig) -> None:
        state = TenantState(
            t.name,
            t.weight,
            t.priority,
            None,
            t.max_requests,
            prefix_cache_group=t.prefix_cache_group,
            deadlines=(t.default_timeout_s, t.max_queue_time_s),
            key_digest=t.api_key_sha256,
        )
        self.tenants[t.name] = state
        self._set_quota(state, t.tokens_per_minute)

    def _set_quota(self, state: TenantState, tokens_per_minute: float | None) -> None:
        level = None
        if state.bucket is not None:  # a resized bucket keeps its level (debt included)
            level = state.bucket.level(self._clock())
        state.tokens_per_minute = tokens_per_minute
        state.bucket = (
            None
            if tokens_per_minute is None
            else TokenBucket(tokens_per_minute, self._clock(), level)
        )

    # ---- keys -----------------------------------------------------------------------------

    @staticmethod
    def _bearer(authorization: str | None) -> str | None:
        if authorization is None:
            return None
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            raise AuthError("the Authorization header must be 'Bearer <API key>'")
        return token.strip()

    def authenticate(self, authorization: str | None) -> TenantState:
        """The tenant of an `Authorization` header; AuthError if there is none to be had."""
        token = self._bearer(authorization)
        if token is None or token in NO_KEY_TOKENS:
            if self.allow_anonymous:
                return self.tenants[self.anonymous]
            raise AuthError("missing API key: send 'Authorization: Bearer <API key>'")
        digest = sha256_hex(token)
        found = None
        for t in self._keyed:  # no early exit: the time taken does not depend on the match
            if hmac.compare_digest(digest, t.key_digest or "") and found is None:
                found = t
        if found is None:
            raise AuthError("invalid API key")
        return found

    def is_admin(self, authorization: str | None) -> bool:
        """True when the header carries the admin key (and one is configured)."""
        if self._admin_digest is None:
            return False
        try:
            token = self._bearer(authorization)
        except AuthError:
            return False
        return token is not None and hmac.compare_digest(sha256_hex(token), self._admin_digest)

    @property
    def admin_enabled(self) -> bool:
        return self._admin_digest is not None

    # ---- admission ------------------------------------------------------------------------

    def max_in_flight(self, tenant: TenantState) -> int:
        """The most requests `tenant` may have in flight at once (each prompt x sample is one)."""
        bound = tenant.max_requests or self.limits.max_requests_per_tenant
        return min(bound, self.limits.max_requests_total)

    def admit(
        self, tenant: TenantState, request_id: str, prompt_tokens: int, created: int
    ) -> Admission:
        """Admit a request or raise Rejected. On success the prompt is charged."""
        refused = self.enforce and refusal(
            tenant.name, tenant.bucket, tenant.in_flight, self.max_in_flight(tenant),
            self.total_in_flight, self.limits.max_requests_total, self.limits.retry_after_s,
            self._clock(),
        )  # fmt: skip
        if refused:
            self.count_rejection(tenant)
            raise refused
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        ticket = Admission(request_id, tenant, self, created, prompt_tokens)
        self.requests[request_id] = ticket
        tenant.in_flight += 1
        tenant.requests_admitted += 1
        self.total_in_flight += 1
        self._charge(tenant, prompt_tokens)
        return ticket

    def release(self, ticket: Admission) -> None:
        """The request ended (finished, failed, cancelled or disconnected). Idempotent."""
        if self.requests.pop(ticket.request_id, None) is None:
            return
        ticket.tenant.in_flight -= 1
        self.total_in_flight -= 1

    def refund(self, ticket: Admission) -> None:
        """Give back the prompt charge of a request the backend refused outright."""
        if ticket.tenant.bucket is not None:
            ticket.tenant.bucket.consume(-ticket.prompt_tokens, self._clock())
        ticket.tenant.tokens_charged -= ticket.prompt_tokens

    def lookup(self, tenant: TenantState, request_id: str) -> Admission | None:
        """The in-flight request `request_id` if `tenant` owns it; None otherwise (also when
        another tenant owns it, so ids of others cannot even be probed)."""
        ticket = self.requests.get(request_id)
        return ticket if ticket is not None and ticket.tenant is tenant else None

    def _charge(self, tenant: TenantState, tokens: int) -> None:
        tenant.tokens_charged += tokens
        if tenant.bucket is not None:
            tenant.bucket.consume(tokens, self._clock())

    def count_rejection(self, tenant: TenantState) -> None:
        tenant.requests_rejected += 1
        self.rejected_total += 1

    # ---- admin ----------------------------------------------------------------------------

    def snapshot(self, name: str) -> TenantSettings:
        """The tenant's changeable settings and quota state, for `restore` (KeyError if unknown)."""
        t = self.tenants[name]
        bucket = None if t.bucket is None else copy.copy(t.bucket)
        return TenantSettings(
            t.name, t.weight, t.priority, t.tokens_per_minute, t.max_requests, bucket,
            t.tokens_charged,
        )  # fmt: skip

    def restore(self, saved: TenantSettings) -> TenantState:
        """Undo every change since `saved` was taken: settings, and the bucket as it was, less
        what the tenant was charged since (so a refused update neither erases nor adds debt)."""
        t = self.tenants[saved.name]
        t.weight, t.priority = saved.weight, saved.priority
        t.tokens_per_minute, t.max_requests = saved.tokens_per_minute, saved.max_requests
        t.bucket = None if saved.bucket is None else copy.copy(saved.bucket)
        if t.bucket is not None:
            t.bucket.consume(t.tokens_charged - saved.tokens_charged, self._clock())
        return t

    def update(
        self,
        name: str,
        *,
        weight: float | None = None,
        priority: int | None = None,
        tokens_per_minute: float | None = None,
        clear_quota: bool = False,
        max_requests: int | None = None,
        clear_max_requests: bool = False,
    ) -> TenantState:
        """Change a tenant's settings (KeyError if unknown); None leaves a field unchanged."""
        state = self.tenants[name]
        if weight is not None:
            state.weight = weight
        if priority is not None:
            state.priority = priority
        if clear_max_requests:
            state.max_requests = None
        elif max_requests is not None:
            state.max_requests = max_requests
        if clear_quota:
            self._set_quota(state, None)
        elif tokens_per_minute is not None:
            self._set_quota(state, tokens_per_minute)
        return state
