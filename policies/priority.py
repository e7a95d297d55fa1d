"""Strict priority classes, weighted fair (or fcfs) inside a class, optional aging.

A request's class is its `.priority` when queued. Each class is its own inner order (a VTC order
with its own lift and "served last" tenant, over the policy-wide counters; or an fcfs order).
The flows of a tenant (policies/flows.py) are lifted over the whole policy, not per class.

Peek without aging: the highest class that has a request of a quota-eligible tenant; inside it,
the inner order's head.

Peek with `aging_s`: a request's effective priority is `.priority + floor(waited / aging_s)`,
`waited = clock() - arrival_time` (not below 0). A class's effective priority is that of its
oldest queued request (smallest arrival_time, whatever its tenant's quota state), i.e. the best
in the class. Classes are tried by (effective priority, class) descending, and the first one
whose inner order has an eligible head answers, with that head: aging lifts a whole class, and
inside it the inner order still decides. Only the oldest request of each class is looked at (a
heap per class), so a peek costs O(classes log classes) plus the inner selection; the answer is
cached until the next time any class's effective priority steps up.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from .base import Policy
from .fcfs import FcfsOrder
from .queues import Entry, LazyHeap, Order
from .tenants import TenantSpec
from .weighted_fair import VtcOrder

if TYPE_CHECKING:
    from fairbatch.scheduler.request import Request

INNER_ORDERS: dict[str, type[Order]] = {"weighted_fair": VtcOrder, "fcfs": FcfsOrder}


class ClassOrder(Order):
    """One priority class: an inner order, plus an arrival-time heap when aging is on."""

    def __init__(self, policy: Policy, inner: Order, aging: bool) -> None:
        super().__init__(policy)
        self.inner = inner
        self.ages: LazyHeap | None = LazyHeap() if aging else None

    def __len__(self) -> int:
        return len(self.inner)

    def add(self, entry: Entry) -> None:
        self.inner.add(entry)
        if self.ages is not None:
            self.ages.push((entry.req.arrival_time, entry.key[2]), entry)

    def discard(self, entry: Entry) -> None:
        self.inner.discard(entry)
        if self.ages is not None:
            self.ages.discarded()

    def taken(self, entry: Entry) -> None:
        self.inner.taken(entry)
        if self.ages is not None:
            self.ages.discarded()

    def select(self) -> Entry | None:
        return self.inner.select()

    def tenant_head(self, tenant: str) -> Entry | None:
        return self.inner.tenant_head(tenant)

    def rank_key(self, req: Request, flag: int) -> tuple:
        return self.inner.rank_key(req, flag)

    def eligibility_changed(self, tenant: str) -> None:
        self.inner.eligibility_changed(tenant)

    def counters_reset(self) -> None:
        self.inner.counters_reset()

    def flows_charged(self, tenant: str) -> bool:
        return self.inner.flows_charged(tenant)

    def tenant_flows(self, tenant: str) -> Iterable[str | None]:
        return self.inner.tenant_flows(tenant)

    def oldest_arrival(self) -> float:
        """arrival_time of the class's oldest queued request; the class must not be empty."""
        assert self.ages is not None
        oldest = self.ages.top()
        assert oldest is not None
        return oldest.req.arrival_time


class PriorityPolicy(Policy):
    """`priority`: strict classes (higher effective priority first), `inner` order inside.

    rank = (-class effective priority, -.priority, *inner rank), where the class effective
    priority is the best of the request's own and that of its queued class (see module doc).
    Inner rank: weighted_fair (counter, 0 requeued | 1 fresh, flow lead, .seq); fcfs (flag,
    flow lead, .seq); see the policies of those names.
    """

    name = "priority"
    preempts_lower_classes = True
    # The inner orders by name (a subclass may offer others: dlpm, lpm).
    inner_orders: ClassVar[Mapping[str, type[Order]]] = INNER_ORDERS

    def __init__(
        self,
        tenants: Iterable[TenantSpec] = (),
        *,
        inner: str = "weighted_fair",
        aging_s: float | None = None,
        **kw: Any,
    ) -> None:
        if inner not in self.inner_orders:
            raise ValueError(f"inner must be one of {sorted(self.inner_orders)}, got {inner!r}")
        if aging_s is not None and not aging_s > 0:
            raise ValueError(f"aging_s must be > 0 or None, got {aging_s}")
        self.inner = inner
        self.aging_s = aging_s
        self._inner_cls = self.inner_orders[inner]
        self._classes: dict[int, ClassOrder] = {}
        self._levels: list[int] = []  # the keys of _classes, highest first
        self._order_uses_counters = self._inner_cls.changes_on_charge
        super().__init__(tenants, **kw)

    def effective_priority(self, req: Request) -> float:
        """`.priority + floor(waited / aging_s)`; just `.priority` without aging."""
        if self.aging_s is None:
            return float(req.priority)
        return float(req.priority + self._steps(req.arrival_time, self.clock()))

    def rank(self, req: Request) -> tuple:
        self.tenant(req.tenant)
        level = self._class(req.priority)
        effective = self.effective_priority(req)
        if self.aging_s is not None and len(level):
            steps = self._steps(level.oldest_arrival(), self.clock())
            effective = max(effective, float(req.priority + steps))
        return (-effective, -req.priority, *level.rank_key(req, self._flag(req)))

    # ---- hooks ---------------------------------------------------------------------------

    def _build_orders(self) -> None:
        pass  # classes are created on first use

    def _order_for(self, req: Request) -> Order:
        return self._class(req.priority)

    def _all_orders(self) -> Iterable[Order]:
        return self._classes.values()

    def _select(self) -> Entry | None:
        if self.aging_s is None:
            for priority in self._levels:
                level = self._classes[priority]
                if len(level):
                    entry = level.select()
                    if entry is not None:
                        return entry
            return None
        return self._select_aged()

    def _select_aged(self) -> Entry | None:
        assert self.aging_s is not None
        now = self.clock()
        candidates: list[tuple[int, int, ClassOrder]] = []
        for priority in self._levels:
            level = self._classes[priority]
            if len(level):
                oldest = level.oldest_arrival()
                steps = self._steps(oldest, now)
                candidates.append((priority + steps, priority, level))
                # The answer may change when this class's effective priority next steps up.
                next_step = oldest + (steps + 1) * self.aging_s
                self._expiry = min(self._expiry, next_step)
        candidates.sort(key=lambda c: (c[0], c[1]), reverse=True)
        for _, _, level in candidates:
            entry = level.select()
            if entry is not None:
                return entry
        return None

    # ---- internals -----------------------------------------------------------------------

    def _class(self, priority: int) -> ClassOrder:
        level = self._classes.get(priority)
        if level is None:
            inner = self._inner_cls(self)
            level = self._classes[priority] = ClassOrder(self, inner, self.aging_s is not None)
            self._levels = sorted(self._classes, reverse=True)
        return level

    def _steps(self, arrival_time: float, now: float) -> int:
        assert self.aging_s is not None
        return math.floor(max(0.0, now - arrival_time) / self.aging_s)
