"""`fairbatch bench serve --compare locality` end to end on tiny settings: four fresh local
servers (fcfs, weighted_fair, lpm, dlpm), the same requests to each. Checked: every request
completes, the rows carry the documented keys, the KV pool defaults to a third of the
prompts' blocks, and each policy gets its own bound (none for fcfs and lpm). No timing is
asserted."""

from __future__ import annotations

import json

from fairbatch.benchmarks.serve_locality import POLICIES
from fairbatch.deployments import cli
from fairbatch.policies.dlpm import DEFAULT_QUANTUM, service_diff_bound

KEYS = {
    "system", "workload", "replicas", "throughput_tok_s", "prefix_hit_rate", "jain",
    "max_service_diff", "bound", "ttft_s", "worst_ttft_p99_s",
}  # fmt: skip


def test_compare_locality_runs_each_policy_on_the_same_requests(tmp_path, capsys):
    out = tmp_path / "out"
    argv = [
        "bench", "serve", "--compare", "locality", "--num-prompts", "12", "--shared-prefix",
        "2,32", "--input-len", "fixed:16", "--output-len", "fixed:16", "--max-num-seqs", "4",
        "--no-plots", "--no-progress", "--out", str(out),
    ]  # fmt: skip
    assert cli.main(argv) == 0
    result = json.loads((out / "result.json").read_text())
    rows = result["table"]
    assert [r["system"] for r in rows] == list(POLICIES)
    assert result["workload"]["num_gpu_blocks"] == 4 * 2 * 2 // 3  # a third of the prompts' blocks
    assert result["workload"]["prefix_hot"] == {"t1": 0.2, "t2": 0.5, "t3": 0.3, "t4": 0.8}
    for r in rows:
        assert KEYS <= set(r) and r["replicas"] == 1 and r["workload"] == "shared_prefix"
        assert r["completed"] == 12 and r["throughput_tok_s"] > 0
        assert 0 <= r["prefix_hit_rate"] <= 1 and 0 < r["jain"] <= 1
        assert set(r["ttft_s"]) == {"t1", "t2", "t3", "t4"}
    bounds = {r["system"]: r["bound"] for r in rows}
    assert bounds["fcfs"] is None and bounds["lpm"] is None and bounds["weighted_fair"] > 0
    # prompts: BOS + 32 system + 16 question tokens; 16 output tokens; 4 seats; min weight 1
    assert bounds["dlpm"] == service_diff_bound(DEFAULT_QUANTUM, 4, 49, 16, 1.0)
    assert "## locality" in capsys.readouterr().out
