"""Per-tenant SLOs and shares (benchmarks/tenant_slo.py), on hand-made results whose numbers
are worked out here by hand."""

from __future__ import annotations

import pytest

from fairbatch.benchmarks import tenant_slo as ts
from fairbatch.benchmarks.serve_types import RequestResult, RequestSpec


def _result(
    tenant: str,
    arrival: float,
    *,
    prompt: int = 10,
    out: int = 5,
    ttft: float | None = 0.1,
    gap: float = 0.01,
    status: int = 200,
    send: float | None = None,
) -> RequestResult:
    """A streamed request: sent at `arrival` (or `send`), first token `ttft` later, then one
    chunk per token `gap` apart."""
    spec = RequestSpec(0, tenant, arrival, "x", prompt, out)
    r = RequestResult(spec, status=status, send_s=arrival if send is None else send)
    if status != 200 or ttft is None:
        r.end_s = r.send_s
        r.error = "refused"
        return r
    first = r.send_s + ttft
    r.ok, r.first_token_s, r.finish_reason = True, first, "length"
    r.chunk_times_s = [first + k * gap for k in range(out)]
    r.end_s = r.chunk_times_s[-1]
    r.prompt_tokens, r.completion_tokens = prompt, out
    return r


def test_max_min_shares_fill_the_small_demands_first():
    assert ts.max_min_shares({"a": 10, "b": 2, "c": 6}, 12) == pytest.approx(
        {"a": 5, "b": 2, "c": 5}
    )
    # everyone satisfied: shares are the demands
    assert ts.max_min_shares({"a": 1, "b": 2}, 12) == pytest.approx({"a": 1, "b": 2})
    # weights 3:1 split 8 as 6:2, unless a demand is below its part
    assert ts.max_min_shares({"a": 10, "b": 10}, 8, {"a": 3}) == pytest.approx({"a": 6, "b": 2})
    assert ts.max_min_shares({"a": 1, "b": 10}, 8, {"a": 3}) == pytest.approx({"a": 1, "b": 7})
    assert ts.max_min_shares({"a": 0.0, "b": 5}, 3) == pytest.approx({"a": 0.0, "b": 3})


def test_slo_attainment_counts_refusals_and_slow_requests_as_misses():
    slo = ts.Slo(ttft_s=0.5, tpot_s=0.05)
    results = [
        _result("a", 0.0),  # met
        _result("a", 1.0, ttft=0.6),  # TTFT miss
        _result("a", 2.0, gap=0.06),  # TPOT miss
        _result("a", 3.0, status=429),  # refused: a miss
        _result("b", 0.0, out=1, gap=9.0),  # one token: any TPOT is met
    ]
    rep = ts.tenant_slos(results, {"a": slo, "b": slo}, t_end=10.0)
    a, b = rep["tenants"]["a"], rep["tenants"]["b"]
    assert (a["sent"], a["completed"], a["refused"], a["failed"]) == (4, 3, 1, 0)
    assert a["attainment"] == pytest.approx(0.25) and b["attainment"] == 1.0
    assert a["goodput_rps"] == pytest.approx(0.1)
    assert rep["goodput_rps"] == pytest.approx(0.2)
    assert rep["attainment"] == pytest.approx(2 / 5)
    assert a["ttft_p50_s"] == pytest.approx(0.1)
    assert a["tpot_p99_s"] == pytest.approx(0.06 - 0.0004, abs=1e-3)


def test_shares_compare_service_with_the_max_min_fair_share_of_what_was_offered():
    slo = ts.Slo(1.0, 1.0)
    # heavy offers 4 requests of cost 10 + 2*5 = 20 but is served 2 of them in the window;
    # light offers 2 and is served both. Window [0, 10): capacity seen = 80.
    results = [
        _result("heavy", 0.0),
        _result("heavy", 1.0),
        _result("heavy", 2.0, ttft=20.0),  # served after the window
        _result("heavy", 3.0, ttft=20.0),
        _result("light", 4.0),
        _result("light", 5.0),
    ]
    rep = ts.tenant_slos(results, {"heavy": slo, "light": slo}, t_end=10.0)
    heavy, light = rep["tenants"]["heavy"], rep["tenants"]["light"]
    assert heavy["offered_per_s"] == pytest.approx(8.0) and light["offered_per_s"] == 4.0
    assert heavy["served_per_s"] == pytest.approx(4.0) and light["served_per_s"] == 4.0
    # capacity 80 in 10 s: light gets all it asked (40), heavy the remaining 40
    assert light["fair_share_per_s"] == pytest.approx(4.0) and light["within_fair_share"]
    assert heavy["fair_share_per_s"] == pytest.approx(4.0) and not heavy["within_fair_share"]
    assert heavy["share_ratio"] == pytest.approx(1.0)
    assert rep["backlogged"] == ["heavy"] and rep["jain_backlogged"] is None


def test_jain_is_taken_over_the_backlogged_tenants_only():
    slo = ts.Slo(1.0, 1.0)
    # a and b each offer 3 requests (cost 20 each); a is served 2, b 1 in [0, 10);
    # c offers 1 and is served it. Capacity seen 80: c 20, a and b 30 each (both backlogged).
    results = [_result("a", t) for t in (0.0, 1.0)] + [_result("a", 2.0, ttft=30.0)]
    results += [_result("b", 0.5)] + [_result("b", t, ttft=30.0) for t in (1.5, 2.5)]
    results += [_result("c", 3.0)]
    rep = ts.tenant_slos(results, {t: slo for t in "abc"}, t_end=10.0)
    assert rep["backlogged"] == ["a", "b"]
    assert rep["tenants"]["a"]["fair_share_per_s"] == pytest.approx(3.0)
    assert rep["tenants"]["b"]["share_ratio"] == pytest.approx(2.0 / 3.0)
    assert rep["jain_backlogged"] == pytest.approx((40 + 20) ** 2 / (2 * (40**2 + 20**2)))


def test_the_windowed_difference_takes_only_windows_where_both_were_backlogged():
    # a and b each have one long request over [0, 130]; a's tokens all land in the first
    # window, b's in the second. Window [0, 60): a got 10 + 2*5 = 20, b 10 (its prompt at its
    # first token) -> 10; window [60, 120): b's 5 tokens x 2 = 10, a 0 -> 10.
    a = _result("a", 0.0, ttft=1.0, gap=1.0)
    a.end_s = 130.0
    b = _result("b", 0.0, ttft=50.0, gap=3.0)
    b.chunk_times_s = [61.0 + 3 * k for k in range(5)]
    b.end_s = 130.0
    assert ts.windowed_service_difference([a, b], t_end=130.0) == pytest.approx(10.0)
    # weights divide the service: a at weight 2 -> 10 vs 10 in the first window, 0 vs 10 next
    assert ts.windowed_service_difference([a, b], 130.0, {"a": 2.0}) == pytest.approx(10.0)
    # a tenant that is not backlogged throughout a window does not count in it
    b.send_s = 70.0
    assert ts.windowed_service_difference([a, b], t_end=130.0) is None
