"""Per-tenant SLOs and shares of a multi-tenant run: what each tenant of a shared server got.

For a run of several tenants (a ServeGen replay, or any workload) this says, per tenant: its
TTFT and TPOT percentiles, how many of its requests met the SLO (a refused request, 429 or
503, or one that failed, is a miss), its goodput, and the service it received against its
max-min fair share of what it offered; over the tenants: Jain's index among the backlogged ones
and the largest service difference between two backlogged tenants in a fixed window, as the
VTC paper reports it (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024,
§5: the "max difference" over 60 s windows).

Service and offered load are VTC cost (prompt tokens + 2 x output tokens), counted while the
arrivals last (`[0, t_end)`): afterwards a draining server serves whoever is left, which says
nothing about sharing. Offered load uses each request's asked-for output (`max_tokens`; the
bench sends ignore_eos), service what the client saw (serve_metrics.service_events).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fairbatch.benchmarks.serve_metrics import (
    REJECTED_STATUSES,
    backlog_intervals,
    jain_index,
    percentile,
    service_events,
    tpot,
)
from fairbatch.benchmarks.serve_types import RequestResult
from fairbatch.benchmarks.serve_workload import OUTPUT_WEIGHT, PROMPT_WEIGHT

FAIRNESS_WINDOW_S = 60.0


@dataclass(frozen=True)
class Slo:
    """A tenant's latency objective: a request meets it with TTFT <= ttft_s and TPOT <= tpot_s
    (a one-token request meets any TPOT)."""

    ttft_s: float
    tpot_s: float

    def met(self, r: RequestResult) -> bool:
        if not r.ok or r.ttft_s is None or r.ttft_s > self.ttft_s:
            return False
        return (tpot(r) or 0.0) <= self.tpot_s


def max_min_shares(
    demand: Mapping[str, float], capacity: float, weights: Mapping[str, float] | None = None
) -> dict[str, float]:
    """Weighted max-min fair (water-filling) shares of `capacity` for tenants offering `demand`:
    a tenant asking less than its weighted level gets what it asks; the rest split what is
    left in proportion to their weights. Sum = min(capacity, sum of demand)."""
    weights = weights or {}
    share = {t: 0.0 for t in demand}
    left = {t for t, d in demand.items() if d > 0}
    room = max(0.0, capacity)
    while left and room > 1e-12:
        total_w = sum(weights.get(t, 1.0) for t in left)
        level = room / total_w
        sated = {t for t in left if demand[t] - share[t] <= level * weights.get(t, 1.0)}
        if not sated:
            for t in left:
                share[t] += level * weights.get(t, 1.0)
            break
        for t in sated:
            room -= demand[t] - share[t]
            share[t] = demand[t]
        left -= sated
    return share


def offered_cost(results: Sequence[RequestResult], t_end: float) -> dict[str, float]:
    """Per tenant: VTC cost of the requests that arrived in [0, t_end), as asked."""
    out: dict[str, float] = {}
    for r in results:
        if r.spec.arrival_s < t_end:
            cost = PROMPT_WEIGHT * r.spec.prompt_len + OUTPUT_WEIGHT * r.spec.max_tokens
            out[r.spec.tenant] = out.get(r.spec.tenant, 0.0) + cost
    return out


def served_cost(
    results: Sequence[RequestResult], t0: float, t1: float, tenants: Sequence[str] = ()
) -> dict[str, float]:
    """Per tenant: VTC cost credited (as the client saw it) in [t0, t1)."""
    out = {t: 0.0 for t in tenants}
    for r in results:
        got = sum(x for t, x in service_events(r) if t0 <= t < t1)
        out[r.spec.tenant] = out.get(r.spec.tenant, 0.0) + got
    return out


def windowed_service_difference(
    results: Sequence[RequestResult],
    t_end: float,
    weights: Mapping[str, float] | None = None,
    window_s: float = FAIRNESS_WINDOW_S,
) -> float | None:
    """The largest difference in weighted service, in one window of `window_s` (back to back
    from 0 up to `t_end`), between two tenants both backlogged (a request sent and not ended)
    throughout that window. None when no window has two such tenants."""
    weights = weights or {}
    backlog = backlog_intervals(list(results))
    worst = None
    t0 = 0.0
    while t0 + window_s <= t_end + 1e-9:
        t1 = t0 + window_s
        busy = [t for t, spans in backlog.items() if any(a <= t0 and t1 <= b for a, b in spans)]
        if len(busy) >= 2:
            got = served_cost(results, t0, t1, busy)
            norm = [got[t] / weights.get(t, 1.0) for t in busy]
            diff = max(norm) - min(norm)
            worst = diff if worst is None else max(worst, diff)
        t0 = t1
    return worst


def tenant_slos(
    results: Sequence[RequestResult],
    slos: Mapping[str, Slo],
    t_end: float,
    *,
    weights: Mapping[str, float] | None = None,
    window_s: float = FAIRNESS_WINDOW_S,
) -> dict:
    """The per-tenant report of a run whose arrivals lasted [0, t_end). `slos`: each tenant's
    objective. Returns {"tenants": {name: {...}}, "jain_backlogged", "backlogged",
    "max_service_difference_window", "window_s", "goodput_rps", "attainment"}."""
    weights = weights or {}
    names = sorted({r.spec.tenant for r in results})
    offered = offered_cost(results, t_end)
    served = served_cost(results, 0.0, t_end, names)
    capacity = sum(served.values())
    demand = {t: offered.get(t, 0.0) for t in names}
    fair = max_min_shares(demand, capacity, weights)
    level_sated = {t for t in names if fair[t] >= demand[t] - 1e-9}
    tenants = {}
    for t in names:
        mine = [r for r in results if r.spec.tenant == t]
        ok = [r for r in mine if r.ok]
        ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
        tpots = [x for x in map(tpot, ok) if x is not None]
        met = sum(1 for r in mine if slos[t].met(r))
        tenants[t] = {
            "sent": len(mine),
            "completed": len(ok),
            "refused": sum(1 for r in mine if r.status in REJECTED_STATUSES),
            "failed": sum(1 for r in mine if not r.ok and r.status not in REJECTED_STATUSES),
            "slo_ttft_s": slos[t].ttft_s,
            "slo_tpot_s": slos[t].tpot_s,
            "attainment": met / len(mine) if mine else None,
            "goodput_rps": met / t_end,
            "ttft_p50_s": _p(ttfts, 50),
            "ttft_p99_s": _p(ttfts, 99),
            "tpot_p50_s": _p(tpots, 50),
            "tpot_p99_s": _p(tpots, 99),
            "offered_per_s": demand[t] / t_end,
            "served_per_s": served[t] / t_end,
            "fair_share_per_s": fair[t] / t_end,
            "share_ratio": served[t] / fair[t] if fair[t] > 0 else None,
            "within_fair_share": t in level_sated,
        }
    backlogged = [t for t in names if t not in level_sated]
    jain = (
        jain_index([served[t] / weights.get(t, 1.0) for t in backlogged])
        if len(backlogged) >= 2
        else None
    )
    total_met = sum(1 for r in results if slos[r.spec.tenant].met(r))
    return {
        "tenants": tenants,
        "backlogged": backlogged,
        "jain_backlogged": jain,
        "max_service_difference_window": windowed_service_difference(
            results, t_end, weights, window_s
        ),
        "window_s": window_s,
        "goodput_rps": total_met / t_end,
        "attainment": total_met / len(results) if results else None,
    }


def _p(values: list[float], q: float) -> float | None:
    return percentile(values, q) if values else None
