"""Metrics for `fairbatch bench serve`: latency, throughput, goodput and fairness, from results.

All times are seconds on the run's time axis (see serve_types). Everything here is computed
from what a client sees, which bounds what it can tell:
  * A request is "backlogged" from when it was sent until its response ended: the client
    cannot tell queued-at-the-server from running, so a tenant with one request in flight is
    backlogged although the server may be serving it at full speed.
  * Service is credited when the client sees it: a request's prompt at its first token (the
    prefill happened before), each output token at the arrival of its chunk.

Service is VTC's cost (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024,
§4): prompt_weight x prompt tokens + output_weight x output tokens, weights 1 and 2 by default.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from fairbatch.benchmarks.serve_types import RequestResult

REJECTED_STATUSES = frozenset({429, 503})
SLO_KEYS = ("ttft_s", "tpot_s", "e2e_s")
# Engine stats that are occupancy gauges, not cumulative counters: reported as their after value.
GAUGES = frozenset({"running", "waiting", "swapped", "kv_usage", "in_flight"})


# -- summaries ---------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (q in [0, 100]) with linear interpolation between the closest ranks
    (numpy's default method). Raises ValueError on an empty sequence or q out of range."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Sequence[float]) -> dict[str, Any]:
    """{"n", "mean", "p50", "p90", "p99"}; for no values n is 0 and the others None."""
    if not values:
        return {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None}
    return {
        "n": len(values),
        "mean": sum(values) / len(values),
        **{f"p{q}": percentile(values, q) for q in (50, 90, 99)},
    }


# -- per-request latency -----------------------------------------------------------------------


def output_tokens(r: RequestResult) -> int:
    """The server's completion token count, or the number of chunks when it reported none."""
    return r.completion_tokens or len(r.chunk_times_s)


def prompt_tokens(r: RequestResult) -> int:
    """The server's prompt token count, or the intended one when it reported none."""
    return r.prompt_tokens or r.spec.prompt_len


def tpot(r: RequestResult) -> float | None:
    """Time per output token after the first: (end - first token) / (output tokens - 1);
    None with fewer than two output tokens or no first token."""
    n = output_tokens(r)
    if r.first_token_s is None or n < 2:
        return None
    return (r.end_s - r.first_token_s) / (n - 1)


def request_metrics(results: list[RequestResult]) -> dict[str, dict]:
    """Summaries of "ttft", "tpot" (per request), "itl" (gaps between consecutive chunks, all
    requests pooled) and "e2e", over the ok results only."""
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpots = [t for t in map(tpot, ok) if t is not None]
    itls = [b - a for r in ok for a, b in zip(r.chunk_times_s, r.chunk_times_s[1:])]
    return {
        "ttft": summarize(ttfts),
        "tpot": summarize(tpots),
        "itl": summarize(itls),
        "e2e": summarize([r.e2e_s for r in ok]),
    }


def throughput(results: list[RequestResult], duration_s: float) -> dict[str, float | int]:
    """Completed requests and their tokens per second of `duration_s`, and the counts of
    completed, rejected (429/503) and failed (any other not-ok) requests."""
    ok = [r for r in results if r.ok]
    out = sum(output_tokens(r) for r in ok)
    total = out + sum(prompt_tokens(r) for r in ok)
    rejected = sum(1 for r in results if not r.ok and r.status in REJECTED_STATUSES)
    return {
        "requests_per_s": len(ok) / duration_s,
        "output_tokens_per_s": out / duration_s,
        "total_tokens_per_s": total / duration_s,
        "completed": len(ok),
        "rejected": rejected,
        "failed": len(results) - len(ok) - rejected,
    }


def goodput(
    results: list[RequestResult],
    duration_s: float,
    *,
    ttft_s: float | None = None,
    tpot_s: float | None = None,
    e2e_s: float | None = None,
) -> float:
    """Completed requests per second that met every given SLO (<= the limit), as vLLM's
    benchmark defines goodput. A one-token request meets any TPOT SLO (its TPOT is 0 there)."""

    def meets(r: RequestResult) -> bool:
        ttft = r.ttft_s
        if ttft_s is not None and (ttft is None or ttft > ttft_s):
            return False
        if tpot_s is not None and (tpot(r) or 0.0) > tpot_s:
            return False
        return e2e_s is None or r.e2e_s <= e2e_s

    return sum(1 for r in results if r.ok and meets(r)) / duration_s


# -- deadlines ---------------------------------------------------------------------------------


def met_deadline(r: RequestResult) -> bool:
    """The request had a `timeout` and completed within it, measured client-side from its
    send; one the server ended with finish_reason "timeout" never counts."""
    timeout = r.spec.timeout
    if timeout is None or not r.ok or r.finish_reason == "timeout":
        return False
    return r.e2e_s <= timeout


def deadline_report(results: list[RequestResult], window_s: float) -> dict[str, Any]:
    """Goodput within deadline: requests that met their deadline (`met_deadline`) per second
    of `window_s`, and the counts behind it: requests sent with a deadline, met, ended by the
    server with "timeout" (and of those, how many after some tokens: evicted while running,
    their work lost), and completed but late (past the deadline, not evicted)."""
    if not window_s > 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    timed = [r for r in results if r.spec.timeout is not None]
    met = sum(1 for r in timed if met_deadline(r))
    timed_out = [r for r in timed if r.ok and r.finish_reason == "timeout"]
    completed = sum(1 for r in timed if r.ok and r.finish_reason != "timeout")
    return {
        "window_s": window_s,
        "with_deadline": len(timed),
        "met": met,
        "timed_out": len(timed_out),
        "timed_out_running": sum(1 for r in timed_out if output_tokens(r) > 0),
        "late": completed - met,
        "goodput_rps": met / window_s,
    }


# -- service and fairness ----------------------------------------------------------------------


def service_events(
    r: RequestResult, prompt_weight: float = 1.0, output_weight: float = 2.0
) -> list[tuple[float, float]]:
    """(time, weighted tokens) credits of one request, as the client sees them: the prompt at
    the first token, the output tokens spread evenly over the chunks (all at end_s when there
    are tokens but no chunks). Nothing before a first token (the prompt is not known served)."""
    if r.first_token_s is None:
        return []
    events = [(r.first_token_s, prompt_weight * prompt_tokens(r))]
    n = output_tokens(r)
    if r.chunk_times_s:
        per_chunk = output_weight * n / len(r.chunk_times_s)
        events += [(t, per_chunk) for t in r.chunk_times_s]
    elif n:
        events.append((r.end_s, output_weight * n))
    return events


def _grid(results: list[RequestResult], step_s: float) -> np.ndarray:
    if not step_s > 0:
        raise ValueError(f"step_s must be > 0, got {step_s}")
    end = max((r.end_s for r in results), default=0.0)
    return np.arange(math.ceil(end / step_s) + 1) * step_s


def _tenants(results: Iterable[RequestResult]) -> list[str]:
    return sorted({r.spec.tenant for r in results})


def _curves(
    results: list[RequestResult], grid: np.ndarray, prompt_weight: float, output_weight: float
) -> dict[str, np.ndarray]:
    curves = {}
    for tenant in _tenants(results):
        events = sorted(
            e
            for r in results
            if r.spec.tenant == tenant
            for e in service_events(r, prompt_weight, output_weight)
        )
        times = np.array([t for t, _ in events])
        cum = np.concatenate([[0.0], np.cumsum([s for _, s in events])])
        curves[tenant] = cum[np.searchsorted(times, grid, side="right")]
    return curves


def service_curves(
    results: list[RequestResult],
    *,
    step_s: float,
    prompt_weight: float = 1.0,
    output_weight: float = 2.0,
) -> tuple[list[float], dict[str, list[float]]]:
    """A grid 0, step_s, 2 step_s, ... up to the last end_s (inclusive, rounded up), and each
    tenant's cumulative service at each grid time (credits at times <= t count)."""
    grid = _grid(results, step_s)
    curves = _curves(results, grid, prompt_weight, output_weight)
    return grid.tolist(), {t: c.tolist() for t, c in curves.items()}


def backlog_intervals(results: list[RequestResult]) -> dict[str, list[tuple[float, float]]]:
    """Per tenant, the sorted, merged [start, end] intervals in which it had at least one request
    sent and not ended (intervals that touch are merged). Client-side: queued at the server and
    in flight look the same from here."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for r in results:
        spans.setdefault(r.spec.tenant, []).append((r.send_s, max(r.send_s, r.end_s)))
    return {t: _merge(s) for t, s in sorted(spans.items())}


def _merge(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]):
    """Intersections of two sorted, disjoint interval lists (two-pointer sweep)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo <= hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def max_service_difference(
    results: list[RequestResult],
    weights: Mapping[str, float],
    *,
    step_s: float = 0.1,
    prompt_weight: float = 1.0,
    output_weight: float = 2.0,
) -> float:
    """max |dS_i/w_i - dS_j/w_j| over tenant pairs (i, j) and grid intervals [t1, t2] in which
    both were backlogged throughout: the quantity VTC's fairness theorem bounds (Sheng et al.,
    Thm 4.3). dS is the service received in [t1, t2]; a tenant missing from `weights` has
    weight 1. 0.0 with fewer than two tenants or no common backlog.

    With D = S_i/w_i - S_j/w_j, the inner max over t1 < t2 in one common-backlog stretch is
    max(D) - min(D) there, so each pair costs O(grid), not O(grid^2).
    """
    grid = _grid(results, step_s)
    curves = _curves(results, grid, prompt_weight, output_weight)
    backlog = backlog_intervals(results)
    tenants = list(curves)
    worst = 0.0
    for k, a in enumerate(tenants):
        for b in tenants[k + 1 :]:
            diff = curves[a] / weights.get(a, 1.0) - curves[b] / weights.get(b, 1.0)
            for lo, hi in _intersect(backlog[a], backlog[b]):
                i, j = np.searchsorted(grid, lo, "left"), np.searchsorted(grid, hi, "right")
                if j - i >= 2:
                    worst = max(worst, float(diff[i:j].max() - diff[i:j].min()))
    return worst


def vtc_bound(
    max_prompt_len: float,
    max_output_tokens: float,
    prompt_weight: float = 1.0,
    output_weight: float = 2.0,
) -> float:
    """2 * max(prompt_weight * L_input, output_weight * M): VTC's bound on the service
    difference of two backlogged tenants (Sheng et al., Thm 4.3), the formula
    benchmarks/cluster_bench.py uses. In the theorem M is the most tokens a running batch
    holds; callers that know it pass it as `max_output_tokens`, otherwise the longest output."""
    return 2 * max(prompt_weight * max_prompt_len, output_weight * max_output_tokens)


def jain_index(xs: Sequence[float]) -> float:
    """Jain's fairness index, (sum x)^2 / (n * sum x^2), in [1/n, 1]: 1.0 when all are equal,
    1/n when one has everything. All zeros is defined as 1.0 (equal shares of nothing: the
    limit of all-equal). Raises ValueError on an empty sequence."""
    if not xs:
        raise ValueError("jain_index of an empty sequence")
    squares = sum(x * x for x in xs)
    return 1.0 if squares == 0 else sum(xs) ** 2 / (len(xs) * squares)


def tenant_report(
    results: list[RequestResult],
    weights: Mapping[str, float],
    duration_s: float,
    *,
    prompt_weight: float = 1.0,
    output_weight: float = 2.0,
) -> dict[str, dict]:
    """Per tenant (those in `weights` and those in `results`): weight, sent, completed, rejected,
    failed, service (weighted tokens), normalized_service (service / weight), service_per_s,
    output_tokens, and ttft / e2e summaries of its ok requests."""
    report = {}
    for tenant in sorted(set(weights) | set(_tenants(results))):
        mine = [r for r in results if r.spec.tenant == tenant]
        ok = [r for r in mine if r.ok]
        counts = throughput(mine, duration_s)
        service = sum(s for r in mine for _, s in service_events(r, prompt_weight, output_weight))
        weight = weights.get(tenant, 1.0)
        report[tenant] = {
            "weight": weight,
            "sent": len(mine),
            "completed": counts["completed"],
            "rejected": counts["rejected"],
            "failed": counts["failed"],
            "service": service,
            "normalized_service": service / weight,
            "service_per_s": service / duration_s,
            "output_tokens": sum(output_tokens(r) for r in ok),
            "ttft": summarize([r.ttft_s for r in ok if r.ttft_s is not None]),
            "e2e": summarize([r.e2e_s for r in ok]),
        }
    return report


# -- the run -----------------------------------------------------------------------------------


def server_delta(before: Mapping | None, after: Mapping | None) -> dict[str, Any]:
    """after - before of GET /admin/stats: the "engine" counters leafwise (gauges such as
    running or kv_usage: the after value) and the top-level "rejected". {} without both."""
    if not before or not after:
        return {}
    delta = _subtract(before.get("engine") or {}, after.get("engine") or {})
    out: dict[str, Any] = {"engine": delta}
    if _is_number(after.get("rejected")) and _is_number(before.get("rejected")):
        out["rejected"] = after["rejected"] - before["rejected"]
    return out


def _subtract(before: Mapping, after: Mapping) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in after.items():
        old = before.get(key)
        if isinstance(value, Mapping):
            out[key] = _subtract(old if isinstance(old, Mapping) else {}, value)
        elif key in GAUGES or not _is_number(value):
            out[key] = value
        else:
            out[key] = value - old if _is_number(old) else value
    return out


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def summarize_run(
    results: list[RequestResult],
    *,
    duration_s: float,
    weights: dict[str, float],
    slo: dict | None = None,
    server_before: dict | None = None,
    server_after: dict | None = None,
    step_s: float = 0.1,
    max_batch_tokens: int | None = None,
    window_s: float | None = None,
) -> dict[str, Any]:
    """One JSON-ready dict for a run: "requests" (latency summaries), "throughput", "goodput"
    (with `slo`: keys among ttft_s, tpot_s, e2e_s), "tenants" (tenant_report), "jain_index"
    over the tenants' normalized service (None without tenants), "max_service_difference" and
    "vtc_bound" (for the run's longest prompt, and `max_batch_tokens` or else its longest
    output) with "vtc_bound_m" saying which ("batch" or "longest output": then the bound is a
    lower estimate, since a batch holds more tokens than one output), "server"
    (server_delta; {} when stats are missing) and, when some request had a deadline,
    "deadlines" (deadline_report per second of `window_s`, default `duration_s`)."""
    if slo is not None and set(slo) - set(SLO_KEYS):
        raise ValueError(f"unknown SLO keys {sorted(set(slo) - set(SLO_KEYS))}; use {SLO_KEYS}")
    tenants = tenant_report(results, weights, duration_s)
    served = [r for r in results if r.first_token_s is not None]
    max_prompt = max((prompt_tokens(r) for r in served), default=0)
    max_output = max((output_tokens(r) for r in served), default=0)
    run = {
        "duration_s": duration_s,
        "requests": request_metrics(results),
        "throughput": throughput(results, duration_s),
        "tenants": tenants,
        "jain_index": jain_index([t["normalized_service"] for t in tenants.values()])
        if tenants
        else None,
        "max_service_difference": max_service_difference(results, weights, step_s=step_s),
        "vtc_bound": vtc_bound(max_prompt, max_batch_tokens or max_output),
        "vtc_bound_m": "batch" if max_batch_tokens else "longest output",
        "server": server_delta(server_before, server_after),
    }
    if slo is not None:
        run["goodput"] = {"slo": dict(slo), "requests_per_s": goodput(results, duration_s, **slo)}
    if any(r.spec.timeout is not None for r in results):
        run["deadlines"] = deadline_report(results, window_s or duration_s)
    return run
