"""The ServeGen replay's simulated cluster (benchmarks/replay_sim.py): virtual time, so its
latencies are exact and repeatable, and a comparison of systems can be asserted."""

from __future__ import annotations

from fairbatch.benchmarks import replay_sim
from fairbatch.benchmarks.serve_types import RequestSpec


def _specs() -> list[RequestSpec]:
    """A heavy tenant's 40 long requests at once fill the 8 seats of each of 2 replicas; a
    quiet tenant sends a short request every 0.5 s from 1 s on."""
    specs = [RequestSpec(i, "heavy", 0.0, "", 512, 256) for i in range(40)]
    specs += [RequestSpec(40 + k, "quiet", 1.0 + 0.5 * k, "", 64, 8) for k in range(6)]
    return specs


def _ttfts(results, tenant):
    return [r.ttft_s for r in results if r.spec.tenant == tenant]


def test_every_request_ends_with_all_its_tokens():
    for system in replay_sim.SYSTEMS:
        results = replay_sim.simulate(_specs(), ["heavy", "quiet"], system, 2, seats=8).results
        assert all(r.ok and r.completion_tokens == r.spec.max_tokens for r in results), system
        assert all(0 < r.ttft_s <= r.e2e_s for r in results)


def test_fair_preemption_gives_the_quiet_tenant_a_seat_at_once():
    """Without it, a quiet request waits for a heavy request to finish (hundreds of decode
    steps); with it, a heavy request gives way and the quiet one starts within a step or two
    of arriving: its worst TTFT is under 3x its idle TTFT."""
    idle = replay_sim.idle_latency(64)["ttft_s"]
    runs = {
        system: replay_sim.simulate(_specs(), ["heavy", "quiet"], system, 2, seats=8)
        for system in ("fairbatch", "fairbatch-nofp", "p2c_fcfs")
    }
    got = {system: _ttfts(run.results, "quiet") for system, run in runs.items()}
    # one heavy request gave way per quiet one, each the moment it came (all seats full)
    assert runs["fairbatch"].preempted == {"heavy": 6}
    assert runs["fairbatch-nofp"].preempted == runs["p2c_fcfs"].preempted == {}
    assert max(got["fairbatch"]) < 3 * idle  # (the bound on a light tenant's p99)
    assert min(got["fairbatch-nofp"]) > 10 * max(got["fairbatch"])
    assert min(got["p2c_fcfs"]) > 10 * max(got["fairbatch"])
