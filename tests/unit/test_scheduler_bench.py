"""The scheduler benchmark's CLI: argument errors, the JSON it writes, the state it measures."""

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
