"""The policy protocol the scheduler depends on: tenant registry, queue, accounting, quotas.

A `Policy` owns the waiting queue of one scheduler and answers "who goes next" (`peek`/`pop`)
and "who gives way" (`pick_victim`). It also keeps per-tenant service accounting (virtual token
counters, VTC) and token-bucket quotas, for every policy: even fcfs needs counters to choose
victims and to report metrics.

Single-threaded: the scheduler's loop is the only caller. Nothing here imports torch or ray.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from types import EllipsisType, MappingProxyType
from typing import TYPE_CHECKING, ClassVar

from .queues import FRESH, REQUEUED, Entry, Order
from .quota import TokenBucket

if TYPE_CHECKING:
    from fairbatch.scheduler.request import Request

_NEVER = math.inf
ORDERS_WITHIN_TENANT = ("fcfs", "edf")


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


class Policy:
    """Base class: tenant registry, waiting queue, service accounting, quotas, preemption.

    Queue contract:
      * A request is identified by `.request_id`; queueing one that is already queued raises
        ValueError. `.tenant`, `.priority` and `.seq` are read once, when it is queued.
      * Inside a tenant, requeued requests come first (by `.seq`), then fresh ones (by `.seq`,
        which the scheduler assigns in admission order, so this is arrival order). With
        `order_within_tenant="edf"`, each of the two goes by earliest deadline (`place`), then
        `.seq`: which of a tenant's requests goes first changes, never how much service the
        tenant gets (tenants are still chosen by the policy's own order).
      * `peek`/`pop` consider only quota-eligible tenants; other requests stay queued.
      * `enqueue`, `requeue`, `pop`, `remove` are O(log n); `peek` is answered from a cache
        that every mutation invalidates, and is O(log tenants) amortized to recompute (round
        robin: O(tenants skipped); priority: O(classes) on top of that).
    Accounting contract:
      * `charge` adds `input_weight*prefill + output_weight*decode` to the tenant's service and
        that divided by the tenant's weight *at charge time* to its virtual counter, and deducts
        `prefill + decode` raw tokens from its quota bucket. Counters also move by the VTC lift
        (weighted_fair) and `set_counters`, so a counter is not always service / weight.
    """

    name: ClassVar[str] = ""
    # Whether charge() can change the answer of peek(); False spares a recompute per step.
    _order_uses_counters: bool = False
    # Whether the policy orders by prefix-cache hits (dlpm, lpm): the scheduler then hands it
    # `set_hit_length(fn)`, fn(request) = prompt tokens of the request cached now.
    wants_hit_length: ClassVar[bool] = False

    def __init__(
        self,
        tenants: Iterable[TenantSpec] = (),
        *,
        input_weight: float = 1.0,
        output_weight: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        order_within_tenant: str = "fcfs",
        **kw: object,
    ) -> None:
        if kw:
            raise TypeError(f"policy {self.name!r} got unexpected keyword arguments: {sorted(kw)}")
        if order_within_tenant not in ORDERS_WITHIN_TENANT:
            raise ValueError(
                f"order_within_tenant must be one of {ORDERS_WITHIN_TENANT}, "
                f"got {order_within_tenant!r}"
            )
        self.order_within_tenant = order_within_tenant
        if input_weight < 0 or output_weight < 0:
            raise ValueError("input_weight and output_weight must be >= 0")
        self.input_weight = float(input_weight)
        self.output_weight = float(output_weight)
        self._clock = clock
        self._specs: dict[str, TenantSpec] = {}
        self._weights: dict[str, float] = {}  # name -> spec.weight (read per tenant per step)
        self._ring: dict[str, int] = {}  # registration number of each tenant (round robin)
        self._counters: dict[str, float] = {}  # mutated in place: orders hold references
        self._service: dict[str, float] = {}
        self._tokens: dict[str, list[int]] = {}  # name -> [prefill, decode] raw tokens charged
        # Decode charged by rate (the scheduler's per-step path): `_rates[t]` requests of t
        # decode one token every step; `charge_decode_step` only counts `_decode_steps`, and
        # t's counter, service and tokens lag by rate x (_decode_steps - _settled[t]) until
        # `_settle(t)`. Everything that reads them settles first: the lag is never visible.
        self._rates: dict[str, int] = {}  # only tenants with a rate > 0
        self._decode_steps = 0
        self._settled: dict[str, int] = {}
        self._buckets: dict[str, TokenBucket] = {}
        self._throttled: set[str] = set()  # tenants with a bucket <= 0 as of the last check
        self._next_wake = _NEVER  # earliest time a throttled tenant may be eligible again
        self._entries: dict[str, Entry] = {}  # request_id -> entry, insertion order
        self._inserted = 0  # insertion counter, the last element of every Entry.key
        self._cached: Entry | None = None  # peek's answer while not _stale and before _expiry
        self._stale = True
        self._expiry = _NEVER
        self._build_orders()
        for spec in tenants:
            self.add_tenant(spec)

    # ---- hooks for subclasses -------------------------------------------------------------

    def _build_orders(self) -> None:
        """Create the orders; called before any tenant is registered."""
        raise NotImplementedError

    def _order_for(self, req: Request) -> Order:
        raise NotImplementedError

    def _all_orders(self) -> Iterable[Order]:
        raise NotImplementedError

    def _select(self) -> Entry | None:
        """The next entry in policy order among eligible tenants. May lower `_expiry`."""
        raise NotImplementedError

    def rank(self, req: Request) -> tuple:
        """Sort key under the current state; smaller = should be served earlier.

        Works for queued and unqueued requests. A request that is not queued (e.g. swapped
        out) is ranked as if it had just been requeued. `rank(peek())` is the smallest rank of
        all queued requests of quota-eligible tenants, so the scheduler may compare a
        swapped-out request's rank with `rank(peek())` to decide which one to resume first.
        """
        raise NotImplementedError

    # ---- tenant registry -----------------------------------------------------------------

    def add_tenant(self, spec: TenantSpec) -> None:
        """Register `spec`, or replace the spec of a tenant with that name.

        Replacing keeps the tenant's counters, service and cycle position; a changed quota
        keeps the bucket's current level (capped at the new capacity).
        """
        name = spec.name
        if name not in self._specs:
            self._ring[name] = len(self._ring)
            self._counters[name] = 0.0
            self._service[name] = 0.0
            self._tokens[name] = [0, 0]
            self._settled[name] = self._decode_steps
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

    # ---- waiting queue -------------------------------------------------------------------

    def enqueue(self, req: Request) -> None:
        """Queue a new arrival behind its tenant's other waiting requests."""
        self._insert(req, FRESH)

    def requeue(self, req: Request) -> None:
        """Queue a preempted request ahead of its tenant's fresh ones (by .seq among requeued).

        Unlike enqueue, it never lifts the tenant's counter (weighted_fair): the tenant was
        being served, it did not idle.
        """
        self._insert(req, REQUEUED)

    def peek(self) -> Request | None:
        """The next request in policy order among quota-eligible tenants, or None."""
        entry = self._head()
        return None if entry is None else entry.req

    def pop(self) -> Request:
        """Remove and return `peek()`; IndexError if no eligible request is queued."""
        entry = self._head()
        if entry is None:
            raise IndexError("pop from a policy with no quota-eligible request queued")
        del self._entries[entry.req.request_id]
        entry.alive = False
        assert entry.order is not None
        entry.order.taken(entry)
        self._stale = True
        return entry.req

    def remove(self, req: Request, *, served: bool = False) -> bool:
        """Take `req` out of the queue (by request_id); False if it was not queued.

        `served=True` says it leaves to run, as `pop` does for the head (the scheduler admits
        by `remove` because a victim requeued during the step may have become the head): the
        order then moves on as after a pop (round robin to the next tenant). Otherwise it is
        a cancellation and the order's position stays.
        """
        entry = self._entries.pop(req.request_id, None)
        if entry is None:
            return False
        entry.alive = False
        assert entry.order is not None
        if served:
            entry.order.taken(entry)
        else:
            entry.order.discard(entry)
        self._stale = True
        return True

    def __len__(self) -> int:
        """Number of queued requests, eligible or not (so `len(p) > 0` with `peek()` None)."""
        return len(self._entries)

    def __iter__(self) -> Iterator[Request]:
        """All queued requests in the order they were queued (not policy order).

        Iterates over a snapshot, so the queue may be changed while iterating.
        """
        return iter([entry.req for entry in self._entries.values()])

    def __contains__(self, req: object) -> bool:
        return getattr(req, "request_id", None) in self._entries

    # ---- accounting ----------------------------------------------------------------------

    def charge(self, tenant: str, prefill_tokens: int, decode_tokens: int) -> None:
        """Account one step's computed tokens of `tenant`. O(1)."""
        if tenant not in self._specs:
            self.tenant(tenant)
        self._settle(tenant)
        self._add(tenant, prefill_tokens, decode_tokens)
        if self._order_uses_counters:
            self._stale = True
        if self._buckets:  # most deployments have no quotas: skip the clock
            self._consume(tenant, prefill_tokens + decode_tokens)

    def charge_step(self, prefill: Mapping[str, int], decode: Mapping[str, int]) -> None:
        """`charge` for every tenant of one step (tenant -> tokens), in one call."""
        for tenant in prefill.keys() | decode.keys():
            self.charge(tenant, prefill.get(tenant, 0), decode.get(tenant, 0))

    def add_decoding(self, tenant: str, n: int) -> None:
        """`n` more (negative: fewer) requests of `tenant` decode one token every step, from
        the next `charge_decode_step` on. The scheduler calls this as requests start and stop
        running, so that its per-step charge is O(tenants that changed), not O(tenants)."""
        if tenant not in self._specs:
            self.tenant(tenant)
        self._settle(tenant)
        rate = self._rates.get(tenant, 0) + n
        if rate < 0:
            raise ValueError(f"tenant {tenant!r}: more requests stopped decoding than started")
        if rate:
            self._rates[tenant] = rate
        else:
            del self._rates[tenant]

    def charge_decode_step(self, missed: Mapping[str, int]) -> None:
        """Charge one step in which every tenant decoded one token per decoding request
        (`add_decoding`), less `missed[tenant]` tokens its requests did not produce this step.
        The same counters, service, tokens, quota levels and throttling as
        `charge_step({}, {t: rate[t] - missed[t]})`, in O(len(missed)) plus quota tenants."""
        self._decode_steps += 1
        rates = self._rates
        for tenant, m in missed.items():
            if m:  # this step differs from the rate: charge it on its own
                self._settle(tenant, self._decode_steps - 1)
                self._settled[tenant] = self._decode_steps
                tokens = rates.get(tenant, 0) - m
                if tokens < 0:
                    raise ValueError(f"tenant {tenant!r}: {m} tokens missed of {tokens + m}")
                self._add(tenant, 0, tokens)
        if self._order_uses_counters:
            self._stale = True
        if self._buckets:
            for tenant in self._buckets:
                tokens = rates.get(tenant, 0) - missed.get(tenant, 0)
                if tokens:
                    self._consume(tenant, tokens)

    def decode_rates(self) -> dict[str, int]:
        """Requests decoding every step, per tenant (a copy)."""
        return dict(self._rates)

    def _add(self, tenant: str, prefill: int, decode: int) -> None:
        cost = self.input_weight * prefill + self.output_weight * decode
        self._service[tenant] += cost
        self._counters[tenant] += cost / self._weights[tenant]
        tokens = self._tokens[tenant]
        tokens[0] += prefill
        tokens[1] += decode

    def _settle(self, tenant: str, upto: int | None = None) -> None:
        """Charge `tenant` the rate-charged steps it has not seen, up to step `upto`."""
        upto = self._decode_steps if upto is None else upto
        k = upto - self._settled[tenant]
        if k > 0:
            self._settled[tenant] = upto
            rate = self._rates.get(tenant)
            if rate:
                self._add(tenant, 0, rate * k)

    def _settle_all(self) -> None:
        for tenant in list(self._rates):
            self._settle(tenant)

    def _counter(self, tenant: str) -> float:
        """The tenant's counter, settled (0.0 for a tenant never seen)."""
        settled = self._settled.get(tenant)
        if settled is None:
            return 0.0
        if settled != self._decode_steps:
            self._settle(tenant)
        return self._counters[tenant]

    def _consume(self, tenant: str, tokens: int) -> None:
        bucket = self._buckets.get(tenant)
        if bucket is not None:
            now = self._clock()
            level = bucket.consume(tokens, now)
            if level <= 0 and tenant not in self._throttled:
                self._throttle(tenant, bucket, now)

    def counters(self) -> dict[str, float]:
        """Virtual counters per tenant (a copy)."""
        self._settle_all()
        return dict(self._counters)

    def counters_view(self) -> Mapping[str, float]:
        """Virtual counters per tenant as a read-only live view, settled as of this call (no
        copy: for a caller that reads a few entries often, such as the cluster controller on
        every admission). Call again after later rate-charged steps."""
        self._settle_all()
        return MappingProxyType(self._counters)

    def set_counters(self, counters: dict[str, float]) -> None:
        """Overwrite the counters of the named tenants (registering unknown ones).

        Used by the cluster controller to share counters; tenants not named keep theirs.
        """
        for name, value in counters.items():
            self.tenant(name)
            self._settle(name)
            self._counters[name] = float(value)
        for order in self._all_orders():
            order.counters_reset()
        self._stale = True

    def service(self) -> dict[str, float]:
        """Cumulative weighted service per tenant (not divided by weight; a copy)."""
        self._settle_all()
        return dict(self._service)

    def tokens(self) -> dict[str, tuple[int, int]]:
        """Raw (prefill, decode) tokens charged per tenant, cumulative (a copy)."""
        self._settle_all()
        return {name: (t[0], t[1]) for name, t in self._tokens.items()}

    # ---- quotas --------------------------------------------------------------------------

    def quota_eligible(self, tenant: str) -> bool:
        """True if the tenant has no quota or its bucket is > 0 now."""
        bucket = self._buckets.get(tenant)
        return bucket is None or bucket.level(self._clock()) > 0

    def retry_after(self, tenant: str) -> float:
        """Seconds until the tenant's bucket is positive again; 0.0 if eligible or no quota."""
        bucket = self._buckets.get(tenant)
        return 0.0 if bucket is None else bucket.retry_after(self._clock())

    # ---- preemption ----------------------------------------------------------------------

    def pick_victim(
        self, running: Iterable[Request], *, below_priority: int | None = None
    ) -> Request | None:
        """The request to preempt: lowest .priority, then the tenant with the highest counter,
        then the latest admission (highest .seq). With `below_priority`, only requests with
        .priority < below_priority are candidates. None if there is no candidate.
        """
        self._settle_all()
        counters = self._counters
        victim = None
        victim_key: tuple[int, float, int] | None = None
        for req in running:
            if below_priority is not None and req.priority >= below_priority:
                continue
            key = (req.priority, -counters.get(req.tenant, 0.0), -req.seq)
            if victim_key is None or key < victim_key:
                victim, victim_key = req, key
        return victim

    def effective_priority(self, req: Request) -> float:
        """The request's priority as the policy uses it: `.priority` (plus aging in `priority`)."""
        return float(req.priority)

    # ---- internals -----------------------------------------------------------------------

    def _insert(self, req: Request, flag: int) -> None:
        rid = req.request_id
        if rid in self._entries:
            raise ValueError(f"request {rid!r} is already queued")
        if req.tenant not in self._specs:
            self.tenant(req.tenant)
        if self._throttled:
            self._wake_throttled()  # the VTC lift must see who is eligible now
        self._inserted += 1
        entry = Entry(req, (flag, self.place(req), self._inserted))
        order = self._order_for(req)
        entry.order = order
        order.add(entry)
        self._entries[rid] = entry
        self._stale = True

    def place(self, req: Request) -> int | tuple[float, int]:
        """Where `req` goes among its tenant's requests of its kind (requeued or fresh): its
        .seq, or under edf (its earliest deadline, .seq). Read when it is queued; requests
        without a deadline (inf) go after those with one."""
        if self.order_within_tenant == "fcfs":
            return req.seq
        deadline = min(getattr(req, "deadline", _NEVER), getattr(req, "queue_deadline", _NEVER))
        return (deadline, req.seq)

    def _flag(self, req: Request) -> int:
        """REQUEUED or FRESH for a queued request; REQUEUED for one that is not queued."""
        entry = self._entries.get(req.request_id)
        return REQUEUED if entry is None else entry.key[0]

    def _head(self) -> Entry | None:
        if self._expiry != _NEVER and self._clock() >= self._expiry:
            self._stale = True
        if self._stale:
            self._wake_throttled()
            self._expiry = self._next_wake if self._throttled else _NEVER
            self._cached = self._select()
            self._stale = False
        return self._cached

    def _set_quota(self, name: str, tokens_per_minute: float | None) -> None:
        bucket = self._buckets.get(name)
        now = self._clock()
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
        now = self._clock()
        if now < self._next_wake:
            return
        self._next_wake = _NEVER
        for name in list(self._throttled):
            bucket = self._buckets[name]
            if bucket.level(now) > 0:
                self._unthrottle(name)
            else:
                self._next_wake = min(self._next_wake, now + bucket.retry_after(now))


class SingleOrderPolicy(Policy):
    """A policy whose whole queue is one `Order` (fcfs, round_robin, weighted_fair)."""

    order_cls: ClassVar[type[Order]]

    def _build_orders(self) -> None:
        self._order = self.order_cls(self)

    def _order_for(self, req: Request) -> Order:
        return self._order

    def _all_orders(self) -> Iterable[Order]:
        return (self._order,)

    def _select(self) -> Entry | None:
        return self._order.select()

    def rank(self, req: Request) -> tuple:
        self.tenant(req.tenant)
        return self._order.rank_key(req, self._flag(req))
