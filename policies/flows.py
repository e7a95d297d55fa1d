"""Fairness between the LoRA adapters of one tenant: a virtual token counter per flow.

A *flow* is a tenant and one LoRA adapter, `(tenant, lora_name)`; the base model (lora_name
None) is a flow too. Tenants are chosen as before, by the policy's own order and the tenant
counters (policies/accounting.py); this is the same VTC one level down, and decides only which
of a tenant's requests goes next:

  * Each flow has a counter of weighted service, `input_weight*prefill + output_weight*decode`
    with the tenant charge's weights, for exactly the tokens the tenant is charged (prompt
    tokens computed for the first time, one decode token per sampled token). All flows of a
    tenant weigh the same, so the counter is not divided by a weight.
  * Inside a tenant, requeued (preempted) requests still go first. Among its fresh ones the
    next is the head (by .seq, or deadline under edf) of the flow with the smallest counter
    that has requests queued, ties by that head's place (policies/queues.py, `TenantQueue`).
  * The lift: a flow that goes from no queued request to one by `enqueue` gets
    max(own, min counter of the tenant's other queued flows), or with none queued,
    max(own, counter of the tenant's flow served last). Idle time banks no credit; `requeue`
    never lifts. "Queued" and "served last" are over the whole policy: under `priority` a flow
    is lifted only while none of its requests waits in any class (so a lift never moves the
    counter of a flow some queue holds; charges do, and re-head those queues).

While a tenant's adapters A and B both stay backlogged, each fresh request the tenant starts is
of the one with the smaller counter; so the one ahead was not ahead at its last fresh start,
and |counter_A - counter_B| is at most what it was charged since (for requests started before
or after, requeued ones included): the tenant-level VTC bound, one level down.

Who charges: the scheduler, once per step, and only on an engine serving LoRA adapters
(`Scheduler.update_from_output` with `loras` set). Elsewhere every request is of the base model,
each tenant has one flow, and flow counters order nothing (they stay 0). The cluster
controller's global queue holds tickets without `lora_name`: one flow per tenant there too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from .queues import FRESH

if TYPE_CHECKING:
    from .queues import Entry

Flow = tuple[str, "str | None"]  # (tenant, lora_name); None: the base model


class FlowAccounting:
    """Counters, service and the lift per flow (the `Policy` methods on flows).

    `FlowAccounting` is a part of `Policy` (policies/base.py), not a class on its own: the
    lift looks at the tenant's queues in the policy's orders, and a charge re-heads them."""

    def _init_flows(self) -> None:
        # tenant -> adapter -> counter. Each tenant's dict is shared, by reference, with the
        # tenant's queues in every order, which read it to choose their head.
        self._flow_counters: dict[str, dict[str | None, float]] = {}
        self._flow_service: dict[Flow, float] = {}
        self._last_flow: dict[str, str | None] = {}  # tenant -> adapter of its last pop

    @staticmethod
    def _adapter(req: object) -> str | None:
        """The request's flow within its tenant (the controller's tickets have no adapter)."""
        return getattr(req, "lora_name", None)

    def _flow_counters_of(self, tenant: str) -> dict[str | None, float]:
        counters = self._flow_counters.get(tenant)
        if counters is None:
            counters = self._flow_counters[tenant] = {}
        return counters

    def _flow_arrives(self, entry: Entry) -> None:
        """`entry` is about to be the first of its flow in its tenant's queue of one order:
        give the flow a counter, lifted (the module doc) if it is fresh and the flow has no
        request queued in any other order either. Orders call this before they push it."""
        tenant, adapter = entry.req.tenant, entry.adapter
        counters = self._flow_counters_of(tenant)
        own = counters.get(adapter, 0.0)
        if entry.key[0] == FRESH:
            queued: set[str | None] = set()
            for order in self._all_orders():  # type: ignore[attr-defined]
                queued.update(order.tenant_flows(tenant))
            if adapter not in queued:
                if queued:
                    own = max(own, min(counters[name] for name in queued))
                elif tenant in self._last_flow:
                    own = max(own, counters[self._last_flow[tenant]])
        counters[adapter] = own

    def charge_flows(self, prefill: Mapping[Flow, int], decode: Mapping[Flow, int]) -> None:
        """Add one step's computed tokens to each flow's counter and service (flow -> tokens).
        The caller charges the tenants the same tokens (`charge_step` and the rate path);
        this moves only the order inside each tenant. O(flows charged + their tenants'
        orders)."""
        w_in, w_out = self.input_weight, self.output_weight  # type: ignore[attr-defined]
        service = self._flow_service
        changed: set[str] = set()
        for flow in prefill.keys() | decode.keys():
            cost = w_in * prefill.get(flow, 0) + w_out * decode.get(flow, 0)
            if not cost:
                continue
            tenant, adapter = flow
            counters = self._flow_counters_of(tenant)
            counters[adapter] = counters.get(adapter, 0.0) + cost
            service[flow] = service.get(flow, 0.0) + cost
            changed.add(tenant)
        stale = False
        for tenant in changed:
            for order in self._all_orders():  # type: ignore[attr-defined]
                stale |= order.flows_charged(tenant)
        if stale:
            self._stale = True

    def flow_counters(self) -> dict[Flow, float]:
        """Virtual counter per flow, `(tenant, lora_name)` -> counter (a copy)."""
        return {
            (tenant, adapter): value
            for tenant, counters in self._flow_counters.items()
            for adapter, value in counters.items()
        }

    def flow_service(self) -> dict[Flow, float]:
        """Cumulative weighted service per flow (no lifts; a copy). A tenant's service is the
        sum of its flows' where the scheduler charges flows (engines serving LoRA)."""
        return dict(self._flow_service)
