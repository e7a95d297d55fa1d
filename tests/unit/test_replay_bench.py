"""The served replay's plumbing (benchmarks/replay_bench.py) on the ServeGen fixture: which
tenants, what load, which SLOs. The servers themselves are exercised by the benchmark."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from fairbatch.benchmarks import replay_bench as rb
from fairbatch.benchmarks import servegen as sg

FIXTURE = Path(__file__).parent / "fixtures" / "servegen"


def _args(**kw) -> argparse.Namespace:
    base = dict(
        servegen_dir=str(FIXTURE), servegen_span=None, servegen_clients=None, heavy=1, tail=1,
        duration=60.0, seed=0, max_input_len=1024, max_output_len=256, slo_factor=5.0,
        slo_ttft=None, slo_tpot=None,
    )  # fmt: skip
    base.update(kw)
    return argparse.Namespace(**base)


def test_the_mix_compresses_the_span_into_the_duration_and_scales_to_a_load():
    mix = rb.build_mix(_args(servegen_span="2:4"))
    assert mix.replay.span == range(2, 6)
    assert mix.replay.duration_s == pytest.approx(60.0)
    assert mix.replay.time_scale == pytest.approx(4 * 600 / 60)
    # the heavy client offers more cost over the span than the tail one
    span, caps = mix.replay.span, mix.replay.caps
    assert mix.clients[mix.heavy[0]].cost_in(span, caps) > mix.clients[mix.tail[0]].cost_in(
        span, caps
    )
    for cost in (100.0, 2500.0):
        assert sg.offered_cost_per_s(mix.clients, mix.at(cost)) == pytest.approx(cost)
    sample = mix.sample(400, "test")
    assert 300 < len(sample) < 500
    assert all(s.prompt_len <= 1024 and s.max_tokens <= 256 for s in sample)


def test_named_clients_are_ranked_and_unknown_ones_refused():
    mix = rb.build_mix(_args(servegen_clients="chunk-18,chunk-27", heavy=1))
    assert sorted(mix.tenants) == ["chunk-18", "chunk-27"] and len(mix.heavy) == 1
    with pytest.raises(ValueError, match="unknown clients \\['chunk-99'\\]"):
        rb.build_mix(_args(servegen_clients="chunk-18,chunk-99"))


def test_slos_are_the_factor_times_the_lowest_idle_latency_of_any_server():
    idle = {
        "a": {"t": {"ttft_s": 0.2, "tpot_s": 0.05}, "u": {"ttft_s": 0.1, "tpot_s": 0.04}},
        "b": {"t": {"ttft_s": 0.3, "tpot_s": 0.02}, "u": {"ttft_s": 0.05, "tpot_s": 0.06}},
    }
    slos = rb.slos_for(_args(slo_factor=4.0), idle, ["t", "u"])
    assert slos["t"].ttft_s == pytest.approx(0.8) and slos["u"].ttft_s == pytest.approx(0.2)
    assert slos["t"].tpot_s == slos["u"].tpot_s == pytest.approx(0.08)
    fixed = rb.slos_for(_args(slo_ttft=500.0, slo_tpot=100.0), idle, ["t", "u"])
    assert (fixed["t"].ttft_s, fixed["u"].tpot_s) == (0.5, 0.1)
