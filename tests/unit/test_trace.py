"""The hop trace (deployments/cluster/trace.py): what it writes, and its summary."""

from __future__ import annotations

import time

import pytest

from fairbatch.deployments.cluster import trace


@pytest.fixture
def traced(tmp_path, monkeypatch):
    monkeypatch.setattr(trace, "DIR", str(tmp_path))
    monkeypatch.setattr(trace, "TENANT", "p")
    monkeypatch.setattr(trace, "_traced", {})
    monkeypatch.setattr(trace, "_file", None)
    monkeypatch.setattr(trace, "_failed", False)
    yield tmp_path
    if trace._file is not None:
        trace._file.close()


def lines(folder) -> list[list[str]]:
    return [line.split() for f in sorted(folder.iterdir()) for line in f.read_text().splitlines()]


def test_only_the_traced_tenant_and_only_each_points_first_time(traced):
    trace.begin("r1", "a", "client")  # another tenant: not traced
    trace.mark("r1", "yielded")
    trace.begin("r2", "p", "client")
    trace.mark("r2", "step_cpu", 0.004)
    trace.mark("r2", "step_cpu", 0.009)  # a later step: the first one counts
    trace.mark("r2", "yielded")
    trace.mark("r3", "yielded")  # never begun here
    got = lines(traced)
    assert [(rid, point) for rid, point, _ in got] == [
        ("r2", "client"),
        ("r2", "step_cpu"),
        ("r2", "yielded"),
    ]
    assert float(got[1][2]) == 0.004
    assert float(got[0][2]) <= float(got[2][2])  # monotonic times


def test_a_folder_it_cannot_write_turns_tracing_off_without_failing(traced, monkeypatch, caplog):
    monkeypatch.setattr(trace, "DIR", str(traced / "missing"))
    trace.begin("r1", "p", "client")  # cannot open: a warning, no exception
    trace.mark("r1", "yielded")
    trace.begin("r2", "p", "client")
    assert "not tracing" in caplog.text
    assert trace._traced == {} and trace._file is None
    assert list(traced.iterdir()) == []


def test_summary_is_the_median_of_each_hop_across_processes(tmp_path):
    # Three requests, their points split over two "processes" as an ingress and a replica.
    # Times in s; hops: client->submit_sent 1, 2, 3 ms; submit_sent->controller missing for
    # r3 (left out), ...
    ingress = {
        "r1": {"client": 10.000, "submit_sent": 10.001, "received": 10.030, "yielded": 10.031},
        "r2": {"client": 20.000, "submit_sent": 20.002, "received": 20.050, "yielded": 20.052},
        "r3": {"client": 30.000, "submit_sent": 30.003, "received": 30.040, "yielded": 30.043},
    }
    replica = {
        # r1 ran in the first step after it arrived (step 5 after 4 had run), r2 waited 2 steps
        "r1": {"controller": 10.004, "step_cpu": 0.005, "added_step": 4, "token_step": 5},
        "r2": {"controller": 20.010, "step_cpu": 0.007, "added_step": 7, "token_step": 10},
    }
    for name, rows in (("1.log", ingress), ("2.log", replica)):
        with open(tmp_path / name, "w") as f:
            for rid, points in rows.items():
                for point, value in points.items():
                    f.write(f"{rid} {point} {value:.6f}\n")
    (tmp_path / "other.txt").write_text("not a trace\n")
    s = trace.summarize(str(tmp_path))
    assert s["n"] == 3
    assert s["client->submit_sent"] == 2.0
    assert s["submit_sent->controller"] == 5.5  # median of 3 and 8 ms (r3 has no controller)
    assert s["received->yielded"] == 2.0
    assert s["step_cpu"] == 6.0
    assert s["total"] == 43.0  # median of 31, 52, 43
    assert (s["steps_waited_max"], s["steps_waited_median"]) == (2, 1.0)
    assert "controller->forwarded" not in s  # nobody has both
    # a window by the `client` time: r2 only
    assert trace.summarize(str(tmp_path), 15.0, 25.0) == {
        "n": 1,
        "client->submit_sent": 2.0,
        "submit_sent->controller": 8.0,
        "received->yielded": 2.0,
        "step_cpu": 7.0,
        "steps_waited_max": 2,
        "steps_waited_median": 2,
        "total": 52.0,
    }


def test_the_step_clock_tells_cpu_from_waiting():
    clock = trace.StepClock()
    clock.begin()
    end = time.thread_time() + 0.02
    while time.thread_time() < end:  # 20 ms of CPU
        pass
    time.sleep(0.05)  # and 50 ms off the CPU
    times = clock.stop()
    wall = times.end - times.start
    assert times.cpu >= 0.02 and wall >= 0.07
    assert times.cpu < wall - 0.04  # the sleep is not CPU
    assert times.wait >= 0.0
