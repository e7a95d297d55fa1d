"""`drive` of the noisy/victim benchmark against the local HTTP server (tiny model): every
victim request is sent once and ends, the noisy streams keep their number of requests in
flight until the duration and stop sending after it, and every token asked for arrives."""

from __future__ import annotations

import asyncio

from fairbatch.benchmarks import noisy_victim as nv
from fairbatch.benchmarks.serve_bench import local_config
from fairbatch.benchmarks.serve_server import LocalServer
from fairbatch.benchmarks.serve_workload import LengthDist, TenantPlan


def test_drive_runs_the_victim_stream_beside_the_noisy_streams():
    w = nv.Workload(
        duration_s=3.0, noisy_streams=3, noisy_input=LengthDist.uniform(4, 12),
        noisy_output=LengthDist.fixed(4), victim_rate=3.0, seed=0,
    )  # fmt: skip
    tenants = [TenantPlan(nv.NOISY), TenantPlan(nv.VICTIM)]
    config = local_config(tenants, {"max_num_seqs": 4})
    with LocalServer(config) as url:
        victim, noisy, duration = asyncio.run(nv.drive(url, "fairbatch-tiny", w))
    specs = w.victim_specs()
    assert [r.spec.arrival_s for r in victim] == [s.arrival_s for s in specs]
    assert all(r.ok and r.completion_tokens == nv.VICTIM_OUTPUT for r in victim)
    assert all(r.send_s >= r.spec.arrival_s for r in victim)
    assert noisy and all(r.ok and r.completion_tokens == 4 for r in noisy)
    # each stream sends its next request when the last ends, only before the duration
    assert sorted(r.spec.index for r in noisy) == list(range(len(noisy)))
    assert all(r.send_s < w.duration_s for r in noisy)
    assert sum(1 for r in noisy if r.end_s > w.duration_s) <= w.noisy_streams
    assert duration >= max(r.end_s for r in victim + noisy)
