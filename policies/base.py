"""The policy protocol the scheduler depends on: a `Policy` and its waiting queue.

A `Policy` owns the waiting queue of one scheduler and answers "who goes next" (`peek`/`pop`)
and "who gives way" (`pick_victim`, policies/victims.py). It also keeps the tenant registry with
token-bucket quotas (policies/tenants.py) and per-tenant service accounting, virtual token
counters (VTC, policies/accounting.py), for every policy: even fcfs needs counters to choose
victims and to report metrics.

What a policy does beyond its order is declared on its class, and callers read only these:
`wants_hit_length`, `preempts_lower_classes`; every policy has `clock` and `kv_shares()`.

Single-threaded: the scheduler's loop is the only caller. Nothing here imports torch or ray.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, ClassVar

from .accounting import Accounting
from .flows import FlowAccounting
from .queues import FRESH, REQUEUED, Entry, Order
from .tenants import TenantRegistry, TenantSpec
from .victims import VictimChoice

if TYPE_CHECKING:
    from fairbatch.scheduler.request import Request

_NEVER = math.inf
ORDERS_WITHIN_TENANT = ("fcfs", "edf")


def _no_hits(req: Request) -> int:
    return 0  # a module-level function, not a lambda: a policy stays picklable


class Policy(TenantRegistry, Accounting, FlowAccounting, VictimChoice):
    """Base class: the waiting queue, over the tenant registry, accounting and victim choice.

    Queue contract:
      * A request is identified by `.request_id`; queueing one that is already queued raises
        ValueError. `.tenant`, `.priority`, `.seq` and `.lora_name` (None if absent) are read
        once, when it is queued.
      * Inside a tenant, requeued requests come first (by `.seq`), then fresh ones (by `.seq`,
        which the scheduler assigns in admission order, so this is arrival order). With
        `order_within_tenant="edf"`, each of the two goes by earliest deadline (`place`), then
        `.seq`: which of a tenant's requests goes first changes, never how much service the
        tenant gets (tenants are still chosen by the policy's own order).
      * Fresh requests of several LoRA adapters of one tenant (flows) share the tenant's
        service by a counter per flow: the next one is the head, by the order above, of the
        flow with the smallest counter (policies/flows.py). Again only which of the tenant's
        requests goes first changes; with one flow, nothing does.
      * `peek`/`pop` consider only quota-eligible tenants; other requests stay queued.
      * `enqueue`, `requeue`, `pop`, `remove` are O(log n); `peek` is answered from a cache
        that every mutation invalidates, and is O(log tenants) amortized to recompute (round
        robin: O(tenants skipped); priority: O(classes) on top of that).
    The accounting contract is in policies/accounting.py, flows in policies/flows.py.
    """

    name: ClassVar[str] = ""  # the registry's key (policies/registry.py); decides nothing
    # Whether charge() can change the answer of peek(); False spares a recompute per step.
    _order_uses_counters: bool = False
    # Whether the policy orders by prefix-cache hits (dlpm, lpm): the scheduler and the
    # controller then call `set_hit_length` and, when the cache moves, `hits_changed`.
    wants_hit_length: ClassVar[bool] = False
    # Whether, on a replica, a waiting request of a strictly higher priority preempts a running
    # one when seats or blocks are short (SchedulerConfig.priority_preemption overrides).
    preempts_lower_classes: ClassVar[bool] = False
    clock: Callable[[], float]  # read by quotas, aging and (by default) request deadlines

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
        self.hit_length: Callable[[Request], int] = _no_hits
        self._init_accounting(input_weight, output_weight)
        self._init_flows()
        self._init_registry(clock)
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

    def set_hit_length(self, hit_length: Callable[[Request], int]) -> None:
        """Use `hit_length(request)` (prompt tokens of it cached now) from now on."""
        if not callable(hit_length):
            raise TypeError(f"hit_length must be callable, got {hit_length!r}")
        self.hit_length = hit_length
        self._stale = True

    def hits_changed(self) -> None:
        """The cache behind `hit_length` moved outside a step (a replica reported to the
        controller): the next peek looks again."""
        self._stale = True

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

    def peek_tenant(self, tenant: str) -> Request | None:
        """The next queued request of `tenant` in policy order, or None (also while its quota
        makes it ineligible). O(the policy's orders)."""
        if not self.quota_eligible(tenant):
            return None
        heads = [e.req for o in self._all_orders() if (e := o.tenant_head(tenant)) is not None]
        return min(heads, key=self.rank, default=None)

    def pop(self) -> Request:
        """Remove and return `peek()`; IndexError if no eligible request is queued."""
        entry = self._head()
        if entry is None:
            raise IndexError("pop from a policy with no quota-eligible request queued")
        del self._entries[entry.req.request_id]
        entry.alive = False
        assert entry.order is not None
        entry.order.taken(entry)
        self._last_flow[entry.req.tenant] = entry.adapter
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
            self._last_flow[entry.req.tenant] = entry.adapter
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

    def _insert(self, req: Request, flag: int) -> None:
        rid = req.request_id
        if rid in self._entries:
            raise ValueError(f"request {rid!r} is already queued")
        if req.tenant not in self._specs:
            self.tenant(req.tenant)
        if self._throttled:
            self._wake_throttled()  # the VTC lift must see who is eligible now
        self._inserted += 1
        entry = Entry(req, (flag, self.place(req), self._inserted), self._adapter(req))
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
        if self._expiry != _NEVER and self.clock() >= self._expiry:
            self._stale = True
        if self._stale:
            self._wake_throttled()
            self._expiry = self._next_wake if self._throttled else _NEVER
            self._cached = self._select()
            self._stale = False
        return self._cached


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
