"""First come, first served, across all tenants."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import SingleOrderPolicy
from .queues import HeadOrder, TenantQueue

if TYPE_CHECKING:
    from fairbatch.scheduler.request import Request


class FcfsOrder(HeadOrder):
    """Global order by `Entry.key`: every requeued request (by .seq), then fresh ones by .seq."""

    def tenant_key(self, tq: TenantQueue) -> tuple:
        assert tq.head is not None
        return tq.head.key

    def rank_key(self, req: Request, flag: int) -> tuple:
        return (flag, self.flow_lead(req, flag), self._policy.place(req))


class FcfsPolicy(SingleOrderPolicy):
    """`fcfs`: pop order is (requeued first, .seq). rank = (0 requeued | 1 fresh, flow lead,
    .seq), the flow lead being `Order.flow_lead`.

    Counters and service are still kept (victim choice, metrics) but never affect the order
    between tenants. Inside a tenant with requests of several LoRA adapters queued, the fresh
    ones go by flow counter first (policies/flows.py), so a tenant's head may not be its oldest.
    """

    name = "fcfs"
    order_cls = FcfsOrder
