"""Round robin across tenants, FIFO within a tenant."""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import TYPE_CHECKING

from .base import SingleOrderPolicy
from .queues import Entry, Order

if TYPE_CHECKING:
    from fairbatch.scheduler.request import Request

    from .base import Policy


class RoundRobinOrder(Order):
    """Each pop serves the next backlogged, eligible tenant in cyclic registration order,
    starting after the tenant served last. Inside a tenant: its queue's head (requeued first,
    then by .seq; by flow counter first when requests of several LoRA adapters are queued).

    `_active` holds the registration numbers of tenants with queued requests, sorted, so a peek
    costs a bisect plus one step per ineligible tenant skipped.
    """

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self._active: list[int] = []
        self._by_ring: dict[int, str] = {}
        self._next = 0  # registration number where the next search starts

    def add(self, entry: Entry) -> None:
        tq = self._queue(entry.req.tenant)
        if tq.live == 0:
            insort(self._active, tq.ring)
            self._by_ring[tq.ring] = tq.name
        self._push(tq, entry)
        entry.tq = tq
        self._live += 1

    def discard(self, entry: Entry) -> None:
        tq = entry.tq
        assert tq is not None
        tq.discarded(entry)
        self._live -= 1
        if tq.live == 0:
            del self._active[bisect_left(self._active, tq.ring)]

    def taken(self, entry: Entry) -> None:
        self.discard(entry)
        assert entry.tq is not None
        self._next = entry.tq.ring + 1

    def flows_charged(self, tenant: str) -> bool:
        tq = self._queues.get(tenant)
        return tq is not None and len(tq.flows) > 1  # select() asks tq.top() afresh

    def select(self) -> Entry | None:
        active = self._active
        count = len(active)
        start = bisect_left(active, self._next)
        throttled = self._policy._throttled
        for step in range(count):
            name = self._by_ring[active[(start + step) % count]]
            if name not in throttled:
                return self._queues[name].top()
        return None

    def rank_key(self, req: Request, flag: int) -> tuple:
        # The tenant's distance from the cycle position, then its place inside the tenant.
        # Rounds are ignored: exact for the head of each tenant, which is what rank is for.
        cycle = len(self._policy._ring)
        return (
            (self._policy._ring[req.tenant] - self._next) % cycle,
            flag,
            self.flow_lead(req, flag),
            self._policy.place(req),
        )


class RoundRobinPolicy(SingleOrderPolicy):
    """`round_robin`: cyclic over tenants in registration order (constructor `tenants` first,
    then tenants first seen by enqueue/requeue/charge/tenant()).

    rank = ((tenant number - cycle position) mod tenants, 0 requeued | 1 fresh, flow lead,
    .seq), the flow lead being `Order.flow_lead`.
    """

    name = "round_robin"
    order_cls = RoundRobinOrder
