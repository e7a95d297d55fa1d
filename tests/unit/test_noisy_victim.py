"""The noisy/victim workload and its report (benchmarks/noisy_victim.py), on hand-made results.
The servers themselves are driven in tests/engine/test_noisy_victim_server.py."""

from __future__ import annotations

import pytest

from fairbatch.benchmarks import noisy_victim as nv
from fairbatch.benchmarks.serve_types import RequestResult, RequestSpec
from fairbatch.benchmarks.serve_workload import LengthDist


def _w(**kw) -> nv.Workload:
    base = dict(
        duration_s=90.0, noisy_streams=48, noisy_input=LengthDist.uniform(12, 96),
        noisy_output=LengthDist.uniform(16, 128), victim_rate=0.3, seed=0,
    )  # fmt: skip
    base.update(kw)
    return nv.Workload(**base)


def test_victim_arrivals_are_seeded_poisson_within_the_duration():
    w = _w(duration_s=2000.0, victim_rate=2.0)
    specs = w.victim_specs()
    assert specs == w.victim_specs()  # deterministic
    assert specs != _w(duration_s=2000.0, victim_rate=2.0, seed=1).victim_specs()
    assert all(0 < s.arrival_s < 2000.0 for s in specs)
    assert [s.arrival_s for s in specs] == sorted(s.arrival_s for s in specs)
    assert [s.index for s in specs] == list(range(len(specs)))
    # 4,000 expected; a Poisson count's standard deviation is sqrt(4000) ~ 63
    assert abs(len(specs) - 4000) < 5 * 63
    assert {(s.tenant, s.prompt_len, s.max_tokens) for s in specs} == {
        (nv.VICTIM, nv.VICTIM_PROMPT, nv.VICTIM_OUTPUT)
    }


def test_noisy_requests_depend_on_their_index_and_draw_from_the_ranges():
    w = _w()
    specs = [w.noisy_spec(k) for k in range(500)]
    assert specs == [w.noisy_spec(k) for k in range(500)]
    assert all(12 <= s.prompt_len <= 96 and 16 <= s.max_tokens <= 128 for s in specs)
    assert len({s.max_tokens for s in specs}) > 50  # spread, not one length
    waves = _w(noisy_output=LengthDist.fixed(64))
    assert {waves.noisy_spec(k).max_tokens for k in range(50)} == {64}


def _result(tenant: str, send: float, first: float | None, end: float, tokens: int, ok=True):
    spec = RequestSpec(0, tenant, send, "x", 4, tokens)
    chunks = [] if first is None else [first + i * (end - first) / max(1, tokens - 1)
                                       for i in range(tokens)]  # fmt: skip
    return RequestResult(
        spec, ok=ok, status=200 if ok else 429, send_s=send, first_token_s=first, end_s=end,
        chunk_times_s=chunks, completion_tokens=tokens if ok else 0,
    )  # fmt: skip


def test_summary_measures_the_victim_against_its_slo_and_counts_every_completed_token():
    victim = [
        _result("victim", 0.0, 0.1, 1.6, 16),  # TTFT 0.1, TPOT 0.1: within
        _result("victim", 1.0, 1.5, 3.0, 16),  # TTFT 0.5: too slow
        _result("victim", 2.0, 2.2, 6.7, 16),  # TTFT 0.2, TPOT 0.3: too slow
        _result("victim", 3.0, None, 3.0, 16, ok=False),  # refused: a miss
    ]
    noisy = [_result("noisy", 0.0, 0.5, 4.0, 100), _result("noisy", 0.0, None, 1.0, 50, ok=False)]
    row = nv.summarize(victim, noisy, 10.0, {"ttft_s": 0.05, "tpot_s": 0.02},
                       {"ttft_s": 0.25, "tpot_s": 0.15})  # fmt: skip
    assert row["victim_sent"] == 4 and row["victim_ok"] == 3
    assert row["victim_ttft_idle_s"] == 0.05
    assert row["victim_ttft_p50_s"] == pytest.approx(0.2)
    assert row["victim_ttft_p90_s"] == pytest.approx(0.2 + 0.8 * 0.3)  # numpy's linear rule
    assert row["victim_ttft_max_s"] == pytest.approx(0.5)
    assert row["victim_e2e_p50_s"] == pytest.approx(2.0)
    assert row["victim_slo_attainment"] == pytest.approx(1 / 4)
    assert row["noisy_completed"] == 1 and row["failed"] == 2
    assert row["output_tokens_per_s"] == pytest.approx((3 * 16 + 100) / 10.0)


def test_rounds_combine_to_medians_and_per_round_ratios():
    def row(tps: float, p50: float | None) -> dict:
        return {"output_tokens_per_s": tps, "victim_ttft_p50_s": p50}

    rounds = [
        {"a": row(100.0, 1.0), "b": row(50.0, None)},
        {"a": row(200.0, 3.0), "b": row(150.0, 0.4)},
        {"a": row(100.0, 2.0), "b": row(90.0, None)},
    ]
    out = nv.combine(rounds)
    assert out["a"]["victim_ttft_p50_s"] == 2.0 and out["a"]["throughput_ratio"] == 1.0
    assert out["b"]["victim_ttft_p50_s"] == 0.4  # the one round that had one
    assert out["b"]["output_tokens_per_s"] == 90.0
    assert out["b"]["throughput_ratio"] == pytest.approx(0.75)  # median of 0.5, 0.75, 0.9
    assert out["b"]["throughput_ratio_range"] == pytest.approx([0.5, 0.9])
