"""Prefix-locality scheduling: longest prefix match (`lpm`) and its fair form (`dlpm`).

Cao et al., "Locality-aware Fair Scheduling in LLM Serving" (2025, arXiv:2501.14312). Serving
the waiting request with the most prompt tokens already in this replica's prefix cache first
(longest prefix match, LPM) saves prefill work and keeps hot prefixes cached, but one tenant
whose requests always hit can take the whole engine. Deficit LPM (DLPM) keeps the LPM order
only among tenants that still have credit: per-tenant deficit counters, refilled by a quantum,
as in deficit round robin.

The policies see no KV blocks. The scheduler gives them `hit_length(request) -> int`: how many
prompt tokens of the waiting request the prefix cache holds now (`set_hit_length`; the
scheduler does this for every policy with `wants_hit_length`, backed by
`KVCacheManager.num_cached_prefix_tokens`, which changes nothing). Without it every hit length
is 0: lpm is then fcfs inside each priority class, dlpm deficit round robin by arrival.

Both keep strict priority classes on top, as `priority` does (they are `PriorityPolicy` with
another inner order, aging included): the highest class with an eligible request goes first, and
the LPM / DLPM order applies inside a class.

`lpm` order inside a class: requeued (preempted) requests first, then the longest hit, then
`.seq`. rank = (-class priority, -.priority, 0 requeued | 1 fresh, -hit, .seq).

`dlpm`, in the units of weighted_fair: a tenant t's service W_t is the weighted tokens charged to
it (`input_weight` per prompt token computed for it, cached ones included, `output_weight` per
generated token: `Policy.charge`), and its counter c_t is W_t / w_t (w_t its weight) plus lifts.
Each class keeps a level L in counter units; t has credit while c_t < L, and its deficit is
d_t = w_t * (L - c_t), the weighted tokens it may still start in this round.
  * Order: among quota-eligible tenants of the class with queued requests and credit, the LPM
    order above. Tenants without credit wait.
  * Refill: when no such tenant has credit, L rises by Q (the `quantum`): every backlogged
    tenant's deficit grows by Q * w_t, its weighted quantum. L rises by as many quanta as it
    takes for one tenant to have credit (rounds in which nobody could start are skipped).
  * Charging: a charge lowers the deficit by exactly what it adds to the service.
  * Lift: a tenant whose queue goes from empty to non-empty by `enqueue` gets
    c_t = max(c_t, min counter of the backlogged tenants (or, with none, of the tenant served
    last: the VTC lift of weighted_fair), L - Q): it starts with at most one quantum of deficit
    and banks nothing while idle. `requeue` never lifts.
rank = (-class priority, -.priority, rounds until the tenant has credit, then the lpm key).

Fairness bound. Let f, g be tenants with all their requests in one class that stay backlogged
(queued requests, quota eligible) while no counters are set from outside. Then at every step
once each of them has started a request (or from the start, when their counters start equal)
    |c_f - c_g| <= B = Q + S * (w_in * P + w_out * D) / min(w_f, w_g),
w_in, w_out the input and output weights, P the longest prompt, D the most tokens a request
generates, S the most requests one tenant can have started and not finished at once
(`max_num_seqs`, plus swapped-out ones when there is swap space). Why:
  1. c_t >= L - Q for every backlogged t: a refill stops as soon as one tenant has credit, so
     right after it every backlogged counter is >= L - Q; counters only grow, and a lift puts a
     newcomer at >= L - Q.
  2. c_t <= L + S * (w_in * P + w_out * D) / w_t once t has started a request: a request starts
     only while c_t < L, and L never falls. After t's last start t is charged only for requests
     it had started by then (at most S), each at most w_in * P + w_out * D over its life
     (several starts in one step, chunked prefill and preemption change neither; a recomputed
     prompt is not charged again).
Over any interval in which both stay backlogged, their weighted services per unit of weight
W_f / w_f and W_g / w_g therefore grow by amounts at most 2B apart. The paper proves a bound of
this shape for DLPM (a quantum term plus VTC's batch term); the argument here is ours, for this
scheduler. A larger Q leaves more room for locality (more hits start before a refill) and a
looser bound; plain lpm has no bound at all: a tenant whose requests always hit starves one
whose requests never do (tests/unit/test_dlpm.py).

Cost: a peek looks up the hit length of every queued request of every tenant with credit
(O(queued requests x hit blocks)); the answer is recomputed after every step, since hit lengths
move with the cache. Inside a tenant the order is by hits too, so a request that never hits
waits behind its tenant's requests that do.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .priority import PriorityPolicy
from .queues import FRESH, Entry, Order
from .tenants import TenantSpec

if TYPE_CHECKING:
    from fairbatch.scheduler.request import Request

    from .base import Policy

DEFAULT_QUANTUM = 2048.0  # weighted tokens per unit of weight and round (a prompt or two)


def service_diff_bound(
    quantum: float,
    slots: int,
    max_prompt: float,
    max_output: float,
    min_weight: float,
    input_weight: float = 1.0,
    output_weight: float = 2.0,
) -> float:
    """2B, B = Q + S * (w_in * P + w_out * D) / w_min (the module doc): the most the weighted
    services per unit of weight of two backlogged tenants can grow apart over an interval."""
    per_request = input_weight * max_prompt + output_weight * max_output
    return 2 * (quantum + slots * per_request / min_weight)


class LpmOrder(Order):
    """Requeued first, then the longest prefix-cache hit, then .seq, over all eligible tenants.

    Hit lengths change with the cache, so nothing is kept sorted: `select` scans the queue.
    """

    changes_on_charge = True  # not the counters: the cache moves with every step

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self._waiting: dict[str, dict[Entry, None]] = {}  # tenant -> its queued entries

    def add(self, entry: Entry) -> None:
        name = entry.req.tenant
        entries = self._waiting.get(name)
        if entries is None:
            self.backlogging(name, entry)
            entries = self._waiting[name] = {}
        entries[entry] = None
        self._live += 1

    def backlogging(self, tenant: str, entry: Entry) -> None:
        """Hook: `entry` is about to give `tenant` its first queued request in this order."""

    def tenant_head(self, tenant: str) -> Entry | None:
        entries = self._waiting.get(tenant)
        if not entries:
            return None
        return min(entries, key=lambda e: self.rank_key(e.req, e.key[0]))

    def discard(self, entry: Entry) -> None:
        name = entry.req.tenant
        entries = self._waiting[name]
        del entries[entry]
        if not entries:
            del self._waiting[name]
        self._live -= 1

    def select(self) -> Entry | None:
        return self._best(self._eligible())

    def rank_key(self, req: Request, flag: int) -> tuple:
        hit = self._policy.hit_length(req)
        return (flag, -hit, self._policy.place(req))

    def _eligible(self) -> list[str]:
        """Tenants with queued requests here that are not over quota."""
        throttled = self._policy._throttled
        return [name for name in self._waiting if name not in throttled]

    def _best(self, tenants: Iterable[str]) -> Entry | None:
        hit_length = self._policy.hit_length
        best, best_key = None, None
        for name in tenants:
            for entry in self._waiting[name]:
                flag, seq, n = entry.key
                key = (flag, -hit_length(entry.req), seq, n)
                if best_key is None or key < best_key:
                    best, best_key = entry, key
        return best


class DlpmOrder(LpmOrder):
    """LPM among the tenants with credit (counter below the level); see the module doc."""

    changes_on_charge = True

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self._quantum: float = policy.quantum  # type: ignore[attr-defined]
        self._counter = policy._counter  # a counter with any pending charge applied
        self._level: float | None = None  # None: anchored at the lowest counter when next used
        self._last_served: str | None = None

    def select(self) -> Entry | None:
        tenants = self._eligible()
        if not tenants:
            return None
        self._level = level = self._refilled(tenants)
        return self._best([name for name in tenants if self._counter(name) < level])

    def rank_key(self, req: Request, flag: int) -> tuple:
        tenants = self._eligible()
        level = self._refilled(tenants) if tenants else self._level
        counter = self._counter(req.tenant)
        if level is None or counter < level:
            rounds = 0
        else:  # the refills it waits for
            rounds = math.floor((counter - level) / self._quantum) + 1
        return (rounds, *super().rank_key(req, flag))

    def level(self) -> float | None:
        """The class's level L as `select` would use it now (None before any use)."""
        tenants = self._eligible()
        return self._refilled(tenants) if tenants else self._level

    def _refilled(self, tenants: list[str]) -> float:
        """The level after the refills due now: unchanged while one of `tenants` has credit,
        else raised by the fewest quanta that give one of them credit. Changes nothing."""
        low = min(self._counter(name) for name in tenants)
        level = low if self._level is None else self._level
        if low < level:
            return level
        q = self._quantum
        level += (math.floor((low - level) / q) + 1) * q
        while level <= low:  # (float rounding)
            level += q
        return level

    def backlogging(self, tenant: str, entry: Entry) -> None:
        if entry.key[0] != FRESH:
            return  # a preempted request's tenant did not idle
        others = self._eligible()
        if others:
            floor = min(self._counter(name) for name in others)
        elif self._last_served is not None:
            floor = self._counter(self._last_served)
        else:
            floor = -math.inf
        if self._level is not None:
            floor = max(floor, self._level - self._quantum)
        if self._counter(tenant) < floor:
            self._policy._counters[tenant] = floor

    def taken(self, entry: Entry) -> None:
        self.discard(entry)
        self._last_served = entry.req.tenant

    def counters_reset(self) -> None:
        # Counters set from outside may have moved anywhere: start over from the lowest one.
        self._level = None


class LpmPolicy(PriorityPolicy):
    """`lpm`: strict priority classes, longest prefix-cache hit first inside a class."""

    name = "lpm"
    wants_hit_length = True
    # Classes order the queue only: a higher class waits for a seat rather than preempting.
    preempts_lower_classes = False
    inner_orders = {"lpm": LpmOrder}

    def __init__(
        self, tenants: Iterable[TenantSpec] = (), *, aging_s: float | None = None, **kw: Any
    ) -> None:
        super().__init__(tenants, inner=self.name, aging_s=aging_s, **kw)


class DlpmPolicy(LpmPolicy):
    """`dlpm`: strict priority classes, deficit longest prefix match inside a class.

    `quantum` (Q): the weighted tokens per unit of weight a backlogged tenant's deficit grows by
    at each refill (tenant t: Q * w_t). See the module doc for the order and the bound.
    """

    name = "dlpm"
    inner_orders = {"dlpm": DlpmOrder}

    def __init__(
        self,
        tenants: Iterable[TenantSpec] = (),
        *,
        quantum: float = DEFAULT_QUANTUM,
        aging_s: float | None = None,
        **kw: Any,
    ) -> None:
        valid = isinstance(quantum, (int, float)) and not isinstance(quantum, bool)
        if not (valid and math.isfinite(quantum) and quantum > 0):
            raise ValueError(
                "dlpm: quantum must be a finite number > 0 (weighted tokens per unit of tenant "
                f"weight and round), got {quantum!r}"
            )
        self.quantum = float(quantum)
        super().__init__(tenants, aging_s=aging_s, **kw)

    def deficits(self, priority: int = 0) -> dict[str, float]:
        """Deficit w_t * (L - c_t) of each tenant with queued requests in class `priority`
        (weighted tokens it may still start before the next refill; <= 0: none)."""
        level = self._classes.get(priority)
        if level is None or not len(level):
            return {}
        order = level.inner
        assert isinstance(order, DlpmOrder)
        value = order.level()
        assert value is not None
        return {
            name: self._weights[name] * (value - self._counter(name)) for name in order._waiting
        }
