"""`fairbatch bench serve --compare deadlines` end to end on tiny settings: four fresh local
servers (fcfs, weighted_fair, weighted_fair + edf, and the last without deadlines sent), the
same requests to each, measured against the same deadlines. The capacity is given and far
below the server's, so every request meets its deadline: what is checked is the plumbing
(rows, counts, the goal's ratio), not timing."""

from __future__ import annotations

import json

import pytest

from fairbatch.benchmarks.serve_compare import DEADLINE_RUNS
from fairbatch.deployments import cli


def test_compare_deadlines_runs_each_configuration_on_the_same_requests(tmp_path, capsys):
    out = tmp_path / "out"
    argv = [
        "bench", "serve", "--compare", "deadlines", "--capacity", "2", "--duration", "2",
        "--scale", "0.2", "--max-num-seqs", "4", "--no-plots", "--no-progress", "--out", str(out),
    ]  # fmt: skip
    assert cli.main(argv) == 0
    result = json.loads((out / "result.json").read_text())
    rows = result["table"]
    assert [r["run"] for r in rows] == [label for label, *_ in DEADLINE_RUNS]
    n = result["workload"]["num_requests"]
    assert n > 0 and result["workload"]["scenario"] == "deadlines"
    for r in rows:
        assert r["with_deadline"] == n and r["met"] == n, r  # underloaded: all in time
        assert r["timed_out"] == 0 and r["late"] == 0
        assert set(r["goodput_rps_by_tenant"]) == {"A", "B"}
    assert [r["deadlines_sent"] for r in rows] == [True, True, True, False]
    assert result["goal"]["edf_vs_no_eviction"] == 1.0 and result["goal"]["target"] == 1.5
    assert "runs" not in result  # per-request rows never go into result.json
    assert "## deadlines" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--rate", "3"], "runs a scenario"),
        (["--scenario", "weighted"], "runs the deadlines scenario"),
    ],
)
def test_compare_deadlines_argument_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "serve", "--compare", "deadlines", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
