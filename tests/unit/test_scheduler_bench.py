"""The scheduler and step-inputs benchmarks' CLI: argument errors, the JSON they write, the
state they measure."""

import json

import pytest

from fairbatch.deployments import cli


@pytest.mark.parametrize(
    "argv",
    [
        ["--policies", "fcfs,nope"],
        ["--rounds", "0"],
        ["--steps", "0"],
    ],
)
def test_bad_arguments_exit_2(argv, capsys) -> None:
    assert cli.main(["bench", "scheduler", *argv]) == 2
    assert "fairbatch bench scheduler:" in capsys.readouterr().err


def test_json_has_the_documented_fields(tmp_path) -> None:
    out = tmp_path / "s.json"
    argv = ["bench", "scheduler", "--policies", "fcfs,priority", "--steps", "30"]
    assert cli.main([*argv, "--rounds", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["policy"] for r in rows] == ["fcfs", "priority"]
    for r in rows:
        assert r["tenants"] == 100 and r["block_size"] == 16 and r["rounds"] == 2
        assert len(r["schedule_ms_median_per_round"]) == 2
        assert len(r["machine_speed_ms_per_round"]) == 2
        assert all(ms > 0 for ms in r["machine_speed_ms_per_round"])
        # the median over rounds is one of the two rounds' medians or between them
        lo, hi = sorted(r["schedule_ms_median_per_round"])
        assert lo <= r["schedule_ms_median"] <= hi
        assert 0 < r["schedule_ms_median"] <= r["schedule_ms_p99"] * 1.0001
        # intake is reported beside the step (it hashes the prompts' blocks)
        assert r["add_request_us_median"] > 0 and r["add_request_ms_per_step_mean"] > 0
        # the measured state: the seats full, the queue at its size (finished ones replaced)
        assert 256 - 8 <= r["running"] <= 256
        assert r["running"] + r["waiting"] == 256 + 5000


def test_the_inputs_bench_times_every_batch_at_every_context_limit(tmp_path) -> None:
    out = tmp_path / "i.json"
    argv = ["bench", "inputs", "--reps", "3", "--contexts", "64", "128", "--json", str(out)]
    assert cli.main(argv) == 0
    result = json.loads(out.read_text())
    rows = result["graph_inputs"]
    cases = [(r["context_mean"], r["max_model_len"], r["batch"]) for r in rows]
    lens, batches = (8192, 32768, 131072), (1, 8, 32, 128, 256)
    assert cases == [(c, n, b) for c in (64, 128) for n in lens for b in batches]
    for r in rows:
        assert r["table_width"] == r["max_model_len"] // 16
        assert 0 < r["inputs_ms_median"] <= r["inputs_ms_p99"]
        assert abs(r["share_of_10ms_step"] - r["inputs_ms_median"] / 10) <= 1e-4
    penalties = result["penalties"]
    assert [(r["context_mean"], r["batch"]) for r in penalties] == [
        (c, b) for c in (64, 128) for b in (8, 32, 128)
    ]
    assert all(r["penalties_ms_median"] > 0 for r in penalties)
