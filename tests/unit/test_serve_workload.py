"""Tests for fairbatch.benchmarks.serve_workload and serve_scenarios: arrivals, lengths, text,
workloads, scenarios."""

from __future__ import annotations

import math
import random
import statistics
import subprocess
import sys

import pytest

from fairbatch.benchmarks.serve_scenarios import SCENARIOS, build_scenario
from fairbatch.benchmarks.serve_workload import (
    DEFAULT_WORDS,
    SHAREGPT_LIKE,
    LengthDist,
    TenantPlan,
    TextMaker,
    arrival_times,
    base_lengths,
    build_workload,
    parse_lengths,
    sharegpt_lengths,
)

# -- arrivals ----------------------------------------------------------------------------------


def gaps(offsets: list[float]) -> list[float]:
    return [b - a for a, b in zip([0.0, *offsets], offsets)]


def test_arrivals_are_seeded_and_sorted():
    a = arrival_times(500, 3.0, rng=random.Random(7))
    assert a == arrival_times(500, 3.0, rng=random.Random(7))
    assert a != arrival_times(500, 3.0, rng=random.Random(8))
    assert len(a) == 500 and a == sorted(a) and a[0] > 0
    assert arrival_times(0, 3.0, rng=random.Random(0)) == []


def test_poisson_mean_gap():
    n, rate = 20_000, 4.0
    g = gaps(arrival_times(n, rate, "poisson", rng=random.Random(1)))
    # exponential gaps: std = mean = 1/rate, so the sample mean's standard error is 1/(rate sqrt n)
    assert abs(statistics.fmean(g) - 1 / rate) < 5 / (rate * math.sqrt(n))
    cv = statistics.pstdev(g) / statistics.fmean(g)
    assert cv == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("shape", [0.25, 1.0, 4.0])
def test_gamma_burstiness_sets_the_coefficient_of_variation(shape):
    n, rate = 20_000, 2.0
    g = gaps(arrival_times(n, rate, "gamma", burstiness=shape, rng=random.Random(2)))
    mean = statistics.fmean(g)
    # mean gap stays 1/rate; its standard error is (1/rate) * CV / sqrt(n), CV = 1/sqrt(shape)
    assert abs(mean - 1 / rate) < 5 * (1 / rate) / math.sqrt(shape * n)
    assert statistics.pstdev(g) / mean == pytest.approx(1 / math.sqrt(shape), rel=0.1)


def test_all_at_once_ignores_rate():
    assert arrival_times(4, 0.0, "all-at-once", rng=random.Random(0)) == [0.0] * 4


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(n=5, rate=0.0),
        dict(n=5, rate=-1.0, process="gamma"),
        dict(n=5, rate=1.0, process="uniform"),
        dict(n=5, rate=1.0, process="gamma", burstiness=0.0),
        dict(n=5, rate=1.0, process="poisson", burstiness=0.5),
        dict(n=-1, rate=1.0),
    ],
)
def test_arrivals_reject_bad_input(kwargs):
    with pytest.raises(ValueError):
        arrival_times(rng=random.Random(0), **kwargs)


# -- lengths -----------------------------------------------------------------------------------


def samples(d: LengthDist, n: int = 50_000, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [d.sample(rng) for _ in range(n)]


def test_fixed_and_uniform():
    d = parse_lengths("fixed:8")
    assert set(samples(d, 100)) == {8} and d.mean == 8
    u = parse_lengths("uniform:3-9")
    xs = samples(u, 5000)
    assert set(xs) == set(range(3, 10)) and u.mean == 6.0


def test_lognormal_mean_and_clip():
    d = parse_lengths("lognormal:50,0.5")
    xs = samples(d)
    assert d.hi == 1024 and min(xs) >= 1
    assert statistics.fmean(xs) == pytest.approx(50, rel=0.02)  # unclipped mean 50, clip rare
    assert abs(statistics.fmean(xs) - d.mean) < 5 * statistics.pstdev(xs) / math.sqrt(len(xs))
    clipped = parse_lengths("lognormal:100,1.5,150")
    ys = samples(clipped)
    assert max(ys) == 150 and clipped.mean < 100  # the clip moves mass from the tail to 150
    assert abs(statistics.fmean(ys) - clipped.mean) < 5 * statistics.pstdev(ys) / math.sqrt(len(ys))
    assert set(samples(parse_lengths("lognormal:20,0"), 50)) == {20}


@pytest.mark.parametrize("spec", ["fixed:8", "uniform:3-9", "lognormal:50,0.5,300"])
def test_spec_round_trips(spec):
    assert str(parse_lengths(spec)) == spec
    assert parse_lengths(str(parse_lengths(spec))) == parse_lengths(spec)


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "fixed:0",
        "fixed:x",
        "gauss:3",
        "uniform:9-3",
        "uniform:0-3",
        "uniform:5",
        "lognormal:10",
        "lognormal:-1,0.5",
        "lognormal:10,-1",
        "lognormal:10,0.5,0",
        "lognormal:10,0.5,9,1",
    ],
)
def test_bad_length_specs_raise(spec):
    with pytest.raises(ValueError):
        parse_lengths(spec)


def test_sharegpt_means_follow_the_paper():
    inp, out = sharegpt_lengths(max_len=1_000_000)  # no clip: the paper's 161 and 338
    assert inp.mean == pytest.approx(161, rel=0.01) and out.mean == pytest.approx(338, rel=0.01)
    small_in, small_out = sharegpt_lengths(0.25, max_len=1_000_000)
    assert small_in.mean == pytest.approx(161 / 4, rel=0.01)
    assert small_out.mean == pytest.approx(338 / 4, rel=0.01)
    # the default clip at 1024 trims the long tail: lower means, never above the clip
    assert SHAREGPT_LIKE[1].mean < 338 and max(samples(SHAREGPT_LIKE[1], 5000)) <= 1024


def test_scaled():
    assert parse_lengths("uniform:10-20").scaled(0.5) == parse_lengths("uniform:5-10")
    assert parse_lengths("fixed:3").scaled(0.1) == parse_lengths("fixed:1")
    assert parse_lengths("lognormal:40,0.5,100").scaled(2) == parse_lengths("lognormal:80,0.5,200")


# -- text --------------------------------------------------------------------------------------


def test_text_is_deterministic_and_sized():
    maker = TextMaker()
    a = maker.make(40, random.Random(5))
    assert a == maker.make(40, random.Random(5)) and a != maker.make(40, random.Random(6))
    assert len(a.split()) == 40 and a.startswith(" ")
    assert len(maker.make(0, random.Random(0)).split()) == 1


def test_text_is_exact_on_the_tiny_tokenizer():
    from fairbatch.engine.tokenizer import Tokenizer  # tokenizers + jinja2, no torch

    tok = Tokenizer.tiny()
    assert all(len(tok.encode(" " + w, add_special_tokens=False)) == 1 for w in DEFAULT_WORDS)
    rng = random.Random(0)
    for n in (1, 7, 64, 500):
        assert len(tok.encode(TextMaker().make(n, rng), add_special_tokens=False)) == n


def test_calibrate_with_any_encoder():
    maker = TextMaker(["alpha", "beta"])
    assert maker.calibrate(lambda s: [0, 0] * len(s.split())) == 2.0
    assert len(maker.make(10, random.Random(0)).split()) == 5


# -- workloads ---------------------------------------------------------------------------------

LENS = dict(input_lens=parse_lengths("uniform:8-32"), output_lens=parse_lengths("fixed:16"))


def test_build_workload_is_reproducible():
    kw = dict(rate=5.0, **LENS, tenants=[TenantPlan("a"), TenantPlan("b")], shared_prefix=(2, 8))
    w = build_workload(50, seed=3, **kw)
    assert w == build_workload(50, seed=3, **kw)
    assert w != build_workload(50, seed=4, **kw)
    assert [r.index for r in w] == list(range(50))


def test_build_workload_tenants_by_weight_with_priority_and_start():
    plans = [TenantPlan("a", weight=1.0), TenantPlan("b", weight=2.0, priority=3)]
    w = build_workload(30, rate=5.0, **LENS, tenants=plans, start_s=10.0)
    assert [r.tenant for r in w].count("a") == 10 and [r.tenant for r in w].count("b") == 20
    assert all(r.priority == (3 if r.tenant == "b" else 0) for r in w)
    assert min(r.arrival_s for r in w) > 10.0
    assert all(8 <= r.prompt_len <= 32 and r.max_tokens == 16 for r in w)
    assert all(r.shared_prefix is None for r in w)


def test_build_workload_shared_prefixes():
    plans = [TenantPlan("a"), TenantPlan("b")]
    w = build_workload(200, rate=5.0, **LENS, tenants=plans, shared_prefix=(3, 12))
    prefix_of: dict[str, str] = {}
    for r in w:
        assert r.shared_prefix is not None and r.shared_prefix.startswith(r.tenant + "/")
        head = " ".join(r.prompt.split()[:12])
        assert prefix_of.setdefault(r.shared_prefix, head) == head  # one text per group
        assert 12 + 8 <= r.prompt_len <= 12 + 32 and len(r.prompt.split()) == r.prompt_len
    assert len(prefix_of) == 6 and len(set(prefix_of.values())) == 6


# -- scenarios ---------------------------------------------------------------------------------

CAPACITY = 10.0  # requests/s of base lengths; large enough that offered loads are tight


@pytest.fixture(scope="module")
def scenarios():
    return {name: build_scenario(name, capacity_rps=CAPACITY, seed=1) for name in SCENARIOS}


def test_all_named_scenarios_exist():
    expected = {"vtc_overload", "vtc_on_off", "vtc_length_shift", "weighted"}
    assert expected | {"priority_burst", "quota_limited", "shared_prefix"} <= set(SCENARIOS)


def test_scenarios_are_well_formed(scenarios):
    for name, sc in scenarios.items():
        assert sc.name == name and sc.description == SCENARIOS[name] and sc.expect
        assert [r.index for r in sc.requests] == list(range(len(sc.requests)))
        arrivals = [r.arrival_s for r in sc.requests]
        assert arrivals == sorted(arrivals) and 0 <= arrivals[0] and arrivals[-1] < 60.0
        assert {r.tenant for r in sc.requests} == {p.name for p in sc.tenants}
        # fits the tiny model's 2048 positions at scale 1
        assert max(r.prompt_len + r.max_tokens for r in sc.requests) <= 2048


def test_scenarios_are_reproducible(scenarios):
    for name in ("vtc_on_off", "shared_prefix"):
        again = build_scenario(name, capacity_rps=CAPACITY, seed=1)
        assert again.requests == scenarios[name].requests
        assert build_scenario(name, capacity_rps=CAPACITY, seed=2).requests != again.requests


def test_vtc_overload_load(scenarios):
    sc = scenarios["vtc_overload"]
    assert sc.offered_load("A") == pytest.approx(2.0, rel=0.1)  # A alone exceeds capacity
    assert sc.offered_load("B") == pytest.approx(1.0, rel=0.1)  # B over its half share


def test_vtc_underload_load(scenarios):
    sc = scenarios["vtc_underload"]
    assert sc.offered_load("A") > 1.5 and sc.offered_load("B") == pytest.approx(0.25, rel=0.15)


def test_vtc_on_off_periods(scenarios):
    sc = scenarios["vtc_on_off"]
    for k in range(6):
        load = sc.offered_load("B", 10.0 * k, 10.0 * (k + 1))
        assert (load == pytest.approx(1.5, rel=0.2)) if k % 2 == 0 else load == 0.0
    assert sc.offered_load("A") == pytest.approx(1.5, rel=0.1)


def test_vtc_length_shift(scenarios):
    b = [r for r in scenarios["vtc_length_shift"].requests if r.tenant == "B"]
    before = [r for r in b if r.arrival_s < 30.0]
    after = [r for r in b if r.arrival_s >= 30.0]
    ratio = statistics.fmean(r.prompt_len for r in after) / statistics.fmean(
        r.prompt_len for r in before
    )
    assert ratio == pytest.approx(2.0, rel=0.1)
    assert len(after) == pytest.approx(len(before), rel=0.15)  # same request rate


def test_weighted_all_backlogged(scenarios):
    sc = scenarios["weighted"]
    assert [p.weight for p in sc.tenants] == [1.0, 2.0, 4.0]
    for p in sc.tenants:  # each offers more than its weighted share of capacity
        assert sc.offered_load(p.name) > 1.2 * p.weight / 7


def test_priority_burst(scenarios):
    sc = scenarios["priority_burst"]
    high = [r for r in sc.requests if r.tenant == "high"]
    assert high and all(r.priority == 1 and 24.0 <= r.arrival_s < 36.0 for r in high)
    assert all(r.priority == 0 for r in sc.requests if r.tenant == "low")
    assert sc.offered_load("low") > 1.0 and sc.offered_load("high", 24, 36) > 0.3


def test_quota_limited(scenarios):
    sc = scenarios["quota_limited"]
    capped = next(p for p in sc.tenants if p.name == "capped")
    sent_per_min = sum(r.prompt_len + r.max_tokens for r in sc.requests if r.tenant == "capped")
    assert capped.tokens_per_minute is not None
    assert capped.tokens_per_minute < 0.3 * sent_per_min  # 60 s run: sent == per minute
    assert next(p for p in sc.tenants if p.name == "free").tokens_per_minute is None


def test_shared_prefix(scenarios):
    sc = scenarios["shared_prefix"]
    assert all(r.shared_prefix and r.shared_prefix.startswith(r.tenant) for r in sc.requests)
    assert len({r.shared_prefix for r in sc.requests}) == 2 * len(sc.tenants)
    assert min(r.prompt_len for r in sc.requests) > 128


def test_scale_scales_lengths():
    full = build_scenario("weighted", capacity_rps=CAPACITY, duration_s=20.0)
    half = build_scenario("weighted", capacity_rps=CAPACITY, duration_s=20.0, scale=0.5)
    mean = statistics.fmean
    assert mean(r.max_tokens for r in half.requests) == pytest.approx(
        0.5 * mean(r.max_tokens for r in full.requests), rel=0.1
    )
    assert base_lengths(0.5)[0].mean == pytest.approx(base_lengths(1.0)[0].mean / 2, rel=0.02)


def test_build_scenario_rejects_bad_input():
    with pytest.raises(ValueError):
        build_scenario("nope", capacity_rps=1.0)
    with pytest.raises(ValueError):
        build_scenario("weighted", capacity_rps=0.0)


def test_modules_import_neither_torch_nor_ray():
    code = (
        "import sys\n"
        "import fairbatch.benchmarks.serve_workload, fairbatch.benchmarks.serve_metrics\n"
        "import fairbatch.benchmarks.serve_scenarios\n"
        "bad = {'torch', 'ray', 'httpx'} & set(sys.modules)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
