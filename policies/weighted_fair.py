"""Weighted fair sharing with virtual token counters (VTC).

Sheng et al., "Fairness in Serving Large Language Models" (OSDI'24). Each tenant t has a counter
that `charge()` raises by `(input_weight*prefill + output_weight*decode) / weight[t]`; the next
request comes from the backlogged tenant with the smallest counter. "Backlogged" means: it has
queued requests and is quota-eligible.

The lift: when a tenant goes from no queued requests to one by `enqueue`, its counter becomes
`max(own, min counter over backlogged tenants)`, or, if no tenant is backlogged,
`max(own, counter of the tenant served last)`: time spent idle banks no credit. `requeue` never
lifts (a preempted tenant did not idle).

Counters move only on `charge()` (after each step), not on `pop()`: consecutive pops between two
charges come from the same tenant while it stays the smallest. The step's token budget bounds
the extra service this gives one tenant.

Inside a tenant the same algorithm runs a level down, over its flows (one per LoRA adapter, and
the base model; policies/flows.py): which of the tenant's fresh requests goes next, never how
much service the tenant gets.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import SingleOrderPolicy
from .queues import FRESH, Entry, HeadOrder, TenantQueue

if TYPE_CHECKING:
    from fairbatch.scheduler.request import Request

    from .base import Policy


class VtcOrder(HeadOrder):
    """Tenant key (counter, *head.key): ties on the counter go to the head that fcfs would
    serve first (requeued before fresh, then lower .seq)."""

    changes_on_charge = True

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self._counters = self._policy._counters
        self._counter = self._policy._counter  # a counter with any pending charge applied
        self._last_served: str | None = None

    def tenant_key(self, tq: TenantQueue) -> tuple:
        assert tq.head is not None
        return (self._counter(tq.name),) + tq.head.key

    def rank_key(self, req: Request, flag: int) -> tuple:
        return (self._counter(req.tenant), flag, self.flow_lead(req, flag), self._policy.place(req))

    def backlogging(self, tq: TenantQueue, entry: Entry) -> None:
        if entry.key[0] != FRESH:
            return
        best = self.select()  # the backlogged tenant with the smallest counter
        if best is not None:
            floor = self._counter(best.req.tenant)
        elif self._last_served is not None:
            floor = self._counter(self._last_served)
        else:
            return
        if self._counter(tq.name) < floor:
            self._counters[tq.name] = floor

    def taken(self, entry: Entry) -> None:
        super().taken(entry)
        self._last_served = entry.req.tenant


class WeightedFairPolicy(SingleOrderPolicy):
    """`weighted_fair`: smallest (counter, requeued first, .seq) head goes next.

    rank = (counter[tenant], 0 requeued | 1 fresh, flow lead, .seq), the flow lead being
    `Order.flow_lead` (0.0 unless the tenant has requests of several flows queued).
    """

    name = "weighted_fair"
    order_cls = VtcOrder
    _order_uses_counters = True
