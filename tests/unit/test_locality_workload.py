"""The locality workloads: system prompts with a per-tenant hot share (`bench serve --compare
locality`) and the open-loop variant of the cluster's shared_prefix workload."""

from __future__ import annotations

import json
import random

from fairbatch.benchmarks import locality_bench as L
from fairbatch.benchmarks.serve_workload import TenantPlan, build_workload, parse_lengths

TENANTS = [TenantPlan("a"), TenantPlan("b", weight=3.0)]


def specs(n=400, **kw):
    return build_workload(
        n, rate=10.0, input_lens=parse_lengths("fixed:4"), output_lens=parse_lengths("fixed:2"),
        tenants=TENANTS, shared_prefix=(4, 8), seed=3, **kw,
    )  # fmt: skip


def test_a_hot_share_sends_that_share_to_the_first_prompt_and_none_changes_nothing():
    assert specs() == specs(prefix_hot={}) == specs(prefix_hot={"a": 0.0})
    got = specs(prefix_hot={"a": 1.0, "b": 0.7})
    assert {s.shared_prefix for s in got if s.tenant == "a"} == {"a/0"}
    b = [s.shared_prefix for s in got if s.tenant == "b"]
    # 0.7 hot + 0.3 x 1/4 uniform picks of the first prompt = 0.775 of b's requests
    assert abs(b.count("b/0") / len(b) - 0.775) < 0.06
    assert set(b) == {f"b/{g}" for g in range(4)}
    prefix = {s.shared_prefix: s.prompt[:40] for s in got}
    assert all(s.prompt.startswith(prefix[s.shared_prefix]) for s in got)


def test_open_loop_arrivals_are_poisson_per_tenant_by_weight():
    arrivals = L.poisson_arrivals(400.0, 5.0, seed=1)
    times = [t for t, _ in arrivals]
    assert times == sorted(times) and 0 < times[0] and times[-1] <= 5.0
    assert abs(len(arrivals) / 5.0 - 400.0) < 40
    total = sum(w for _, w, _, _ in L.TENANTS)
    for name, w, _, _ in L.TENANTS:
        share = sum(1 for _, n in arrivals if n == name) / len(arrivals)
        assert abs(share - w / total) < 0.04
    assert arrivals == L.poisson_arrivals(400.0, 5.0, seed=1)


def test_the_open_loop_run_serves_what_arrives_below_capacity():
    row = L.run_one(2, "d2lpm", 1.5, rate=20.0)
    assert row["workload"] == "shared_prefix_open" and row["rate_rps"] == 20.0
    # 20 requests/s of 32 output tokens: about 640 tok/s offered, all served (virtual time)
    assert 300 < row["throughput_tok_s"] < 1000
    assert 0 < row["prefix_hit_rate"] <= 1 and 0 < row["jain"] <= 1.0  # (few arrivals: noisy)
    closed = L.run_one(2, "weighted_fair", 1.5)
    assert closed["workload"] == "shared_prefix" and closed["rate_rps"] is None


def test_the_popularity_shift_moves_the_hot_share_to_the_second_prompt():
    rng = random.Random(0)
    assert {L.pick_prompt(rng, 1.0, 6, shifted=False) for _ in range(50)} == {0}
    assert {L.pick_prompt(rng, 1.0, 6, shifted=True) for _ in range(50)} == {1}
    picks = [L.pick_prompt(rng, 0.5, 6, shifted=True) for _ in range(6000)]
    # 0.5 hot + 0.5 x 1/6 uniform picks of the second prompt; the first gets only its 1/12
    assert abs(picks.count(1) / len(picks) - 7 / 12) < 0.03
    assert abs(picks.count(0) / len(picks) - 1 / 12) < 0.02
    row = L.run_one(2, "d2lpm", 1.5, rate=20.0, shift_s=0.5)
    assert row["workload"] == "shared_prefix_open_shift" and row["shift_s"] == 0.5
    assert row["peak_replica_waiting"] >= 0


def test_main_writes_the_rows_and_a_ttft_plot(tmp_path):
    path = tmp_path / "shift.json"
    rows = L.main(
        str(path), replicas=(2,), systems=["d2lpm"], duration_s=1.0, load=0.5, shift_s=0.3
    )
    assert [r["workload"] for r in rows] == ["shared_prefix", "shared_prefix_open_shift"]
    assert json.loads(path.read_text()) == rows
    assert (tmp_path / "shift_ttft_p99.png").stat().st_size > 0
