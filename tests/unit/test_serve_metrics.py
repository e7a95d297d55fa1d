"""Tests for fairbatch.benchmarks.serve_metrics against values computed by hand."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from fairbatch.benchmarks.serve_metrics import (
    backlog_intervals,
    goodput,
    jain_index,
    max_service_difference,
    percentile,
    request_metrics,
    server_delta,
    service_curves,
    summarize,
    summarize_run,
    tenant_report,
    throughput,
    vtc_bound,
)
from fairbatch.benchmarks.serve_report import fairness_line
from fairbatch.benchmarks.serve_types import RequestResult, RequestSpec


def result(
    tenant: str = "a",
    send: float = 0.0,
    first: float | None = None,
    end: float = 0.0,
    chunks: list[float] | tuple = (),
    prompt: int = 0,
    completion: int = 0,
    ok: bool = True,
    status: int = 200,
    prompt_len: int = 10,
) -> RequestResult:
    spec = RequestSpec(0, tenant, send, "x", prompt_len, max(1, completion))
    return RequestResult(
        spec,
        ok=ok,
        status=status,
        send_s=send,
        first_token_s=first,
        end_s=end,
        chunk_times_s=list(chunks),
        prompt_tokens=prompt,
        completion_tokens=completion,
    )


# -- summaries ---------------------------------------------------------------------------------


def test_percentile_by_hand():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 90) == pytest.approx(3.7)  # rank 2.7: 3 + 0.7 * (4 - 3)
    assert percentile([7.0], 99) == 7.0


def test_percentile_matches_numpy():
    rng = random.Random(3)
    for n in (1, 2, 5, 17, 100):
        xs = [rng.uniform(-5, 5) for _ in range(n)]
        for q in (0, 1, 25, 50, 90, 99, 99.9, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), abs=1e-12)


def test_percentile_rejects_empty_and_bad_q():
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summarize():
    s = summarize([1.0, 2.0, 3.0, 4.0])
    assert s["n"] == 4 and s["mean"] == 2.5 and s["p50"] == 2.5
    assert s["p99"] == pytest.approx(3.97)
    assert summarize([]) == {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None}


def test_jain_index():
    assert jain_index([1, 1, 1, 1]) == 1.0
    assert jain_index([1, 0, 0, 0]) == 0.25
    assert jain_index([1, 2]) == pytest.approx(9 / 10)  # 3^2 / (2 * (1 + 4))
    assert jain_index([0, 0, 0]) == 1.0  # defined: equal shares of nothing
    with pytest.raises(ValueError):
        jain_index([])


def test_vtc_bound():
    assert vtc_bound(100, 50) == 200  # 2 * max(1 * 100, 2 * 50)
    assert vtc_bound(300, 50) == 600
    assert vtc_bound(100, 50, prompt_weight=1.0, output_weight=4.0) == 400


# -- latency, throughput, goodput --------------------------------------------------------------


def test_request_metrics_tpot_itl_on_hand_made_results():
    r1 = result(send=0.0, first=1.0, end=3.0, chunks=[1.0, 1.5, 2.5, 3.0], completion=4)
    r2 = result(send=1.0, first=2.0, end=2.25, chunks=[2.0, 2.25], completion=2)
    failed = result(send=0.0, first=0.1, end=9.0, chunks=[0.1, 9.0], ok=False, status=500)
    m = request_metrics([r1, r2, failed])
    assert m["ttft"]["n"] == 2 and m["ttft"]["mean"] == 1.0
    # tpot: (3 - 1) / 3 and (2.25 - 2) / 1
    assert m["tpot"]["n"] == 2
    assert m["tpot"]["mean"] == pytest.approx((2 / 3 + 0.25) / 2)
    # itl pooled: [0.5, 1.0, 0.5] from r1 and [0.25] from r2; the failed 8.9 gap excluded
    assert m["itl"]["n"] == 4
    assert m["itl"]["mean"] == pytest.approx(2.25 / 4)
    assert m["itl"]["p50"] == pytest.approx(0.5)
    assert m["e2e"]["mean"] == pytest.approx((3.0 + 1.25) / 2)


def test_tpot_needs_two_tokens():
    one = result(send=0.0, first=1.0, end=1.0, chunks=[1.0], completion=1)
    assert request_metrics([one])["tpot"]["n"] == 0


def test_throughput_counts_and_rates():
    results = [
        result(ok=True, prompt=10, completion=4),
        result(ok=True, prompt=20, completion=2),
        result(ok=False, status=429),
        result(ok=False, status=503),
        result(ok=False, status=500),
        result(ok=False, status=0),
    ]
    t = throughput(results, 10.0)
    assert (t["completed"], t["rejected"], t["failed"]) == (2, 2, 2)
    assert t["requests_per_s"] == pytest.approx(0.2)
    assert t["output_tokens_per_s"] == pytest.approx(0.6)
    assert t["total_tokens_per_s"] == pytest.approx(3.6)


def test_goodput_with_slos():
    # r1: ttft 0.5, tpot 1.5/15 = 0.1, e2e 2.0; r2: ttft 2, tpot 1/20 = 0.05, e2e 3;
    # r3: ttft 0.25, tpot 1/4 = 0.25, e2e 1.25. The failed one would meet every SLO.
    r1 = result(send=0.0, first=0.5, end=2.0, completion=16)
    r2 = result(send=1.0, first=3.0, end=4.0, completion=21)
    r3 = result(send=0.0, first=0.25, end=1.25, completion=5)
    bad = result(send=0.0, first=0.1, end=0.2, completion=2, ok=False, status=500)
    rs = [r1, r2, r3, bad]
    assert goodput(rs, 10.0) == pytest.approx(0.3)
    assert goodput(rs, 10.0, ttft_s=1.0) == pytest.approx(0.2)  # r1, r3
    assert goodput(rs, 10.0, ttft_s=1.0, tpot_s=0.2) == pytest.approx(0.1)  # r1
    assert goodput(rs, 10.0, e2e_s=2.0) == pytest.approx(0.2)  # r1 (exactly 2.0), r3
    assert goodput(rs, 10.0, tpot_s=0.06) == pytest.approx(0.1)  # r2
    assert goodput(rs, 10.0, ttft_s=0.1) == 0.0


# -- service and fairness ----------------------------------------------------------------------


def two_tenants() -> list[RequestResult]:
    # a: prompt 4 at t=1, 3 output tokens one per chunk (x2 each): +6 @1, +2 @2, +2 @3
    a = result("a", send=0.0, first=1.0, end=3.0, chunks=[1, 2, 3], prompt=4, completion=3)
    # b: 4 tokens over 2 chunks (2 each, x2 = 4 per chunk), prompt 3: +7 @2, +4 @4
    b = result("b", send=0.5, first=2.0, end=4.0, chunks=[2, 4], prompt=3, completion=4)
    return [a, b]


def test_service_curves_by_hand():
    grid, curves = service_curves(two_tenants(), step_s=1.0)
    assert grid == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert curves == {"a": [0, 6, 8, 10, 10], "b": [0, 0, 7, 7, 11]}


def test_service_curves_weights_and_fallbacks():
    # No usage reported: prompt falls back to spec.prompt_len (5), output to the chunk count.
    r = result("a", send=0.0, first=1.0, end=2.0, chunks=[1, 2], prompt_len=5)
    _, curves = service_curves([r], step_s=1.0, prompt_weight=2.0, output_weight=3.0)
    assert curves["a"] == [0, 13, 16]  # 2*5 + 3 at t=1, +3 at t=2


def test_service_without_first_token_is_zero():
    r = result("a", send=0.0, first=None, end=1.0, ok=False, status=429)
    _, curves = service_curves([r], step_s=0.5)
    assert curves["a"] == [0, 0, 0]


def test_backlog_intervals_merge():
    rs = [
        result("a", send=0, end=1),
        result("a", send=0.5, end=2),
        result("a", send=3, end=4),
        result("a", send=4, end=5),  # touches: merged
        result("b", send=1, end=1.5),
    ]
    assert backlog_intervals(rs) == {"a": [(0, 2), (3, 5)], "b": [(1, 1.5)]}


def test_max_service_difference_by_hand():
    # common backlog [0.5, 3]: grid 1, 2, 3, where a - b = 6, 1, 3: max - min = 5
    assert max_service_difference(two_tenants(), {"a": 1, "b": 1}, step_s=1.0) == 5.0


def test_max_service_difference_ignores_stretch_without_common_backlog():
    # a is served 14 alone in [0, 2]; b only arrives at 3. In the common stretch [3, 5] both get
    # +3 @4 and +2 @5, so the difference there is 0, while over the whole run it is 14.
    rs = [
        result("a", send=0, first=1, end=2, chunks=[1, 2], prompt=10, completion=2),
        result("a", send=3, first=4, end=5, chunks=[4, 5], prompt=1, completion=2),
        result("b", send=3, first=4, end=5, chunks=[4, 5], prompt=1, completion=2),
    ]
    assert max_service_difference(rs, {"a": 1, "b": 1}, step_s=1.0) == 0.0
    # sanity of the setup: a really was 14 ahead when b arrived
    _, curves = service_curves(rs, step_s=1.0)
    assert curves["a"][3] - curves["b"][3] == 14


def test_max_service_difference_on_a_two_point_stretch():
    # common backlog [0.9, 2] holds grid points 1 and 2 only: a - b = 4 - 0, then 6 - 3
    a = result("a", send=0, first=1, end=2, chunks=[1, 2], prompt=2, completion=2)
    b = result("b", send=0.9, first=2, end=2.5, chunks=[2], prompt=1, completion=1)
    assert max_service_difference([a, b], {"a": 1, "b": 1}, step_s=1.0) == 1.0


def test_max_service_difference_weighted():
    # a: +4 @1, +2 @2, +2 @3 -> [0, 4, 6, 8]; b: +3 @1, +2 @2, +2 @3 -> [0, 3, 5, 7]
    a = result("a", send=0, first=1, end=3, chunks=[1, 2, 3], prompt=2, completion=3)
    b = result("b", send=0, first=1, end=3, chunks=[1, 2, 3], prompt=1, completion=3)
    # weights 1: a - b = [0, 1, 1, 1] -> 1; a weighted 2: a/2 - b = [0, -1, -2, -3] -> 3
    assert max_service_difference([a, b], {"a": 1, "b": 1}, step_s=1.0) == 1.0
    assert max_service_difference([a, b], {"a": 2, "b": 1}, step_s=1.0) == 3.0


def test_max_service_difference_single_tenant_is_zero():
    assert max_service_difference(two_tenants()[:1], {"a": 1}, step_s=1.0) == 0.0


def brute_force_difference(results, weights, step_s):
    """O(grid^2) reference: every grid pair [t1, t2] inside one backlog interval of each."""
    grid, curves = service_curves(results, step_s=step_s)
    backlog = backlog_intervals(results)
    tenants = sorted(curves)

    def inside(t1, t2, spans):
        return any(lo <= t1 and t2 <= hi for lo, hi in spans)

    worst = 0.0
    for x, a in enumerate(tenants):
        for b in tenants[x + 1 :]:
            d = [sa / weights[a] - sb / weights[b] for sa, sb in zip(curves[a], curves[b])]
            for i in range(len(grid)):
                for j in range(i + 1, len(grid)):
                    t1, t2 = grid[i], grid[j]
                    if inside(t1, t2, backlog[a]) and inside(t1, t2, backlog[b]):
                        worst = max(worst, abs(d[j] - d[i]))
    return worst


def random_results(rng: random.Random, n: int) -> list[RequestResult]:
    out = []
    for _ in range(n):
        send = rng.uniform(0, 8)
        first = send + rng.uniform(0, 1)
        chunks = sorted(first + rng.uniform(0, 2) for _ in range(rng.randint(1, 6)))
        chunks[0] = first
        out.append(
            result(
                rng.choice("abc"),
                send=send,
                first=first,
                end=chunks[-1],
                chunks=chunks,
                prompt=rng.randint(1, 30),
                completion=rng.randint(1, 8),
            )
        )
    return out


@pytest.mark.parametrize("seed", range(8))
def test_max_service_difference_matches_brute_force(seed):
    rng = random.Random(seed)
    rs = random_results(rng, 12)
    weights = {"a": 1.0, "b": 2.0, "c": 0.5}
    expected = brute_force_difference(rs, weights, 0.25)
    assert max_service_difference(rs, weights, step_s=0.25) == pytest.approx(expected)


# -- reports -----------------------------------------------------------------------------------


def test_tenant_report():
    rs = [*two_tenants(), result("b", send=1, end=1.1, ok=False, status=429)]
    rep = tenant_report(rs, {"a": 1.0, "b": 2.0, "idle": 1.0}, duration_s=4.0)
    assert rep["a"]["service"] == 10 and rep["a"]["normalized_service"] == 10
    assert rep["b"]["service"] == 11 and rep["b"]["normalized_service"] == 5.5
    assert (rep["b"]["sent"], rep["b"]["completed"], rep["b"]["rejected"]) == (2, 1, 1)
    assert rep["b"]["ttft"]["mean"] == 1.5 and rep["a"]["e2e"]["mean"] == 3.0
    assert rep["idle"]["sent"] == 0 and rep["idle"]["service"] == 0


STATS_BEFORE = {
    "object": "stats",
    "engine": {
        "preemptions": {"swap": 1, "recompute": 2},
        "swapped_bytes": {"in": 10, "out": 20},
        "prefix_hit_tokens": 5,
        "running": 3,
        "kv_usage": 0.5,
    },
    "rejected": 1,
    "in_flight": 2,
}
STATS_AFTER = {
    "object": "stats",
    "engine": {
        "preemptions": {"swap": 4, "recompute": 2},
        "swapped_bytes": {"in": 30, "out": 20},
        "prefix_hit_tokens": 105,
        "running": 0,
        "kv_usage": 0.125,
    },
    "rejected": 6,
    "in_flight": 0,
}


def test_server_delta():
    d = server_delta(STATS_BEFORE, STATS_AFTER)
    assert d["engine"] == {
        "preemptions": {"swap": 3, "recompute": 0},
        "swapped_bytes": {"in": 20, "out": 0},
        "prefix_hit_tokens": 100,
        "running": 0,
        "kv_usage": 0.125,
    }
    assert d["rejected"] == 5
    assert server_delta(None, STATS_AFTER) == {}
    assert server_delta({"engine": {}}, {"engine": {"x": 2}}) == {"engine": {"x": 2}}


def test_summarize_run_is_json_ready():
    rs = [*two_tenants(), result("b", send=1, end=1.1, ok=False, status=429)]
    run = summarize_run(
        rs,
        duration_s=4.0,
        weights={"a": 1.0, "b": 1.0},
        slo={"ttft_s": 1.0},
        server_before=STATS_BEFORE,
        server_after=STATS_AFTER,
        step_s=1.0,
    )
    json.dumps(run)
    assert run["throughput"]["completed"] == 2 and run["throughput"]["rejected"] == 1
    assert run["goodput"]["requests_per_s"] == pytest.approx(0.25)  # only a's ttft is <= 1
    assert run["jain_index"] == pytest.approx(21**2 / (2 * (10**2 + 11**2)))
    assert run["max_service_difference"] == 5.0
    assert run["vtc_bound"] == 2 * max(4, 2 * 4)  # longest prompt 4, longest output 4
    assert run["vtc_bound_m"] == "longest output"
    line = fairness_line(run)
    assert line.endswith("(VTC bound 16, M = the longest output: a lower estimate)"), line
    known = summarize_run(rs, duration_s=4.0, weights={"a": 1.0, "b": 1.0}, max_batch_tokens=64)
    assert known["vtc_bound"] == 2 * 2 * 64 and known["vtc_bound_m"] == "batch"
    assert fairness_line(known).endswith("(VTC bound 256)")
    assert run["server"]["engine"]["prefix_hit_tokens"] == 100


def test_summarize_run_without_server_stats_or_results():
    run = summarize_run([], duration_s=1.0, weights={})
    json.dumps(run)
    assert run["server"] == {} and run["jain_index"] is None and "goodput" not in run
    with pytest.raises(ValueError):
        summarize_run([], duration_s=1.0, weights={}, slo={"ttft": 1.0})


# -- what a run writes ------------------------------------------------------------------------


def test_result_json_is_a_summary_and_rows_go_to_raw_out(tmp_path):
    """result.json keeps the summary (floats to 6 significant digits, short containers on one
    line); request rows, a run's or each compared run's (with its label), go to --raw-out only."""
    import argparse

    from fairbatch.benchmarks.serve_bench import compact_json, write_results

    data = {"x": 1 / 3, "short": [1, 2.5], "long": list(range(40)), "none": None}
    text = compact_json(data)
    assert json.loads(text) == {**data, "x": 0.333333}
    assert '"short": [1, 2.5]' in text and '"x": 0.333333' in text
    assert all(len(line) <= 100 for line in text.splitlines())

    raw = tmp_path / "raw" / "requests.jsonl"
    args = argparse.Namespace(raw_out=str(raw))
    run = {"kind": "run", "summary": {"ttft": 0.1}, "requests": [{"index": 0}, {"index": 1}]}
    write_results(args, tmp_path, run)
    assert json.loads((tmp_path / "result.json").read_text()) == {
        "kind": "run",
        "summary": {"ttft": 0.1},
    }
    assert [json.loads(line) for line in raw.read_text().splitlines()] == [
        {"index": 0},
        {"index": 1},
    ]

    compare = {"kind": "compare", "table": [{"p": 1}], "runs": {"fcfs": {"requests": [{"i": 0}]}}}
    write_results(argparse.Namespace(raw_out=None), tmp_path, compare)
    assert set(json.loads((tmp_path / "result.json").read_text())) == {"kind", "table"}
    compare["runs"] = {"fcfs": {"requests": [{"i": 0}]}, "wf": {"requests": [{"i": 1}]}}
    write_results(args, tmp_path, compare)
    assert [json.loads(line) for line in raw.read_text().splitlines()] == [
        {"run": "fcfs", "i": 0},
        {"run": "wf", "i": 1},
    ]
