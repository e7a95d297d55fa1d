"""Per-tenant service accounting of a `Policy`: virtual token counters (VTC), weighted service,
raw tokens, and the rate-charged decode of the scheduler's per-step path.

`Accounting` is a part of `Policy` (policies/base.py), not a class on its own: charging a
tenant also draws on its quota (policies/tenants.py) and may change the policy's queue order.

Contract:
  * `charge` adds `input_weight*prefill + output_weight*decode` to the tenant's service and
    that divided by the tenant's weight *at charge time* to its virtual counter, and deducts
    `prefill + decode` raw tokens from its quota bucket. Counters also move by the VTC lift
    (weighted_fair) and `set_counters`, so a counter is not always service / weight.
  * A tenant is charged the same whatever LoRA adapter its requests use (an adapter's load
    costs it nothing). How its service splits among its adapters is counted per flow by
    `charge_flows` (policies/flows.py), which orders the tenant's own requests only.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType


class Accounting:
    """Counters, service and tokens per tenant (the `Policy` methods on accounting)."""

    def _init_accounting(self, input_weight: float, output_weight: float) -> None:
        if input_weight < 0 or output_weight < 0:
            raise ValueError("input_weight and output_weight must be >= 0")
        self.input_weight = float(input_weight)
        self.output_weight = float(output_weight)
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

    def _open_account(self, tenant: str) -> None:
        self._counters[tenant] = 0.0
        self._service[tenant] = 0.0
        self._tokens[tenant] = [0, 0]
        self._settled[tenant] = self._decode_steps

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
