"""The usage log (deployments/usage.py) and the controller's ledger (usage_ledger.py): records
kept in order across rotation, sums over a half-open period, periods parsed or refused, and
the ledger writing each request exactly once: the ingress's record, or the controller's own
for a request whose ingress died, never both, also across a controller restart."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from fairbatch.deployments.cluster.usage_ledger import UsageLedger
from fairbatch.deployments.cluster.wire import RequestMeta
from fairbatch.deployments.usage import UsageLog, UsageRecord, UsageSpec, parse_period
from fairbatch.engine.sampling_params import LoRARequest, SamplingParams


def record(i: int, tenant: str = "a", end: float = 1000.0, **kw) -> UsageRecord:
    base = UsageRecord(
        f"req-{i:05d}", f"req-{i:05d}", tenant, "m", 10 + i, i % 3, 5 + i, 0, "stop",
        end - 2.0, end - 1.0, end,
    )  # fmt: skip
    return replace(base, **kw)


def test_rotation_keeps_the_newest_records_in_order_within_the_size_bound(tmp_path):
    spec = UsageSpec(str(tmp_path / "usage.jsonl"), max_bytes=1024, backups=2)
    log = UsageLog(spec)
    for i in range(200):
        log.append([record(i)])
    files = log.files()
    assert [p.name for p in files] == ["usage.jsonl.2", "usage.jsonl.1", "usage.jsonl"]
    assert all(p.stat().st_size <= 1024 for p in files)
    ids = [r["request_id"] for r in log.records()]
    # the kept records are the newest ones, each once, in the order they were appended
    assert ids == [f"req-{i:05d}" for i in range(200 - len(ids), 200)]
    # ... and as many as three full files hold: rotation lost only the oldest
    per_file = 1024 // len(record(199).to_json() + "\n")
    assert len(ids) > 2 * per_file
    log.close()
    again = UsageLog(spec)  # reopened: appends after what is there
    again.append([record(200)])
    assert again.records()[-1]["request_id"] == "req-00200"
    assert [r["request_id"] for r in again.records()][:-1] == ids


def test_no_backups_starts_over(tmp_path):
    log = UsageLog(UsageSpec(str(tmp_path / "u.jsonl"), max_bytes=1024, backups=0))
    for i in range(50):
        log.append([record(i)])
    assert [p.name for p in log.files()] == ["u.jsonl"]
    assert log.records()[-1]["request_id"] == "req-00049"


def test_summary_sums_per_tenant_over_a_half_open_period(tmp_path):
    log = UsageLog(UsageSpec(str(tmp_path / "u.jsonl")))
    rows = [
        record(1, "a", end=100.0),
        record(2, "a", end=150.0, finish_reason="length", reasoning_tokens=4),
        record(3, "b", end=150.0, finish_reason="client_gone"),
        record(4, "a", end=200.0),  # at `until`: outside
        record(5, "a", end=99.5),  # before `since`
    ]
    log.append(rows)
    got = log.summary(None, 100.0, 200.0)
    assert got["since"] == 100.0 and got["until"] == 200.0
    a = got["tenants"]["a"]
    assert a == {
        "requests": 2,
        "prompt_tokens": 11 + 12,
        "cached_tokens": 1 + 2,
        "output_tokens": 6 + 7,
        "reasoning_tokens": 4,
        "finish_reasons": {"stop": 1, "length": 1},
    }
    assert got["tenants"]["b"]["finish_reasons"] == {"client_gone": 1}
    only_b = log.summary("b", -math.inf, math.inf)
    assert list(only_b["tenants"]) == ["b"] and only_b["since"] is None
    assert log.summary("a", 300.0, 400.0)["tenants"] == {}


def test_periods_are_parsed_or_refused_naming_the_bound():
    assert parse_period("100", "200.5") == (100.0, 200.5)
    assert parse_period(None, None) == (-math.inf, math.inf)
    lo, hi = parse_period("1970-01-01T00:01:40Z", "1970-01-01T00:03:20")  # naive: UTC
    assert (lo, hi) == (100.0, 200.0)
    assert parse_period("1970-01-01T01:01:40+01:00", None)[0] == 100.0
    for since, until, word in [
        ("yesterday", None, "since"),
        (None, "nan", "until"),
        ("200", "100", "before"),
        ("100", "100", "before"),
    ]:
        with pytest.raises(ValueError, match=word):
            parse_period(since, until)


def test_spec_rejects_bad_settings():
    for kw, word in [({"path": ""}, "path"), ({"max_bytes": 10}, "max_bytes"),
                     ({"backups": -1}, "backups")]:  # fmt: skip
        with pytest.raises(ValueError, match=word):
            UsageSpec(**{"path": "x", **kw})


# ---- the controller's ledger ---------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def meta(rid: str, tenant: str = "a", prompt: int = 7, lora: str | None = None) -> RequestMeta:
    params = SamplingParams(max_tokens=16, lora=None if lora is None else LoRARequest(lora, "/x"))
    return RequestMeta(rid, list(range(prompt)), params, tenant=tenant)


def sent(r: UsageRecord) -> tuple[str, str]:
    """A record as an ingress sends it to the controller."""
    return r.request_id, r.to_json()


def lines(ledger: UsageLedger) -> list[dict]:
    return [json.loads(x) for x in ledger.log.path.read_text().splitlines()]


def test_an_ingress_record_closes_its_entry_and_is_written_once(tmp_path):
    clock = Clock()
    ledger = UsageLedger(UsageSpec(str(tmp_path / "u.jsonl")), "base", grace_s=5, clock=clock)
    ledger.submitted(meta("r1"))
    ledger.left_replica("r1", "rep-0", 9)
    ledger.record([sent(record(1, request_id="r1"))])
    ledger.record([sent(record(1, request_id="r1"))])  # a retried submission: dropped
    clock.now += 60
    assert ledger.sweep(live=set()) == 0 and ledger.sweep(live=set()) == 0
    assert [r["request_id"] for r in lines(ledger)] == ["r1"]
    assert lines(ledger)[0]["recorded_by"] == "ingress"


def test_a_request_whose_ingress_died_is_recorded_by_the_controller_after_the_grace(tmp_path):
    clock = Clock()
    ledger = UsageLedger(UsageSpec(str(tmp_path / "u.jsonl")), "base", grace_s=5, clock=clock)
    ledger.submitted(meta("r1", prompt=11))
    ledger.submitted(meta("r2", lora="sql"))
    first = meta("r3")
    ledger.submitted(first)
    ledger.left_replica("r3", "rep-0", 4)  # its replica died after 4 tokens ...
    again = meta("r3")
    again.output_ids, again.attempt = [1, 2, 3, 4], 1  # ... resubmitted with them
    ledger.submitted(again)
    assert ledger.sweep(live={"r1", "r2", "r3"}) == 0
    ledger.left_replica("r1", "rep-1", 6)
    ledger.left_replica("r3", "rep-2", 3)
    assert ledger.sweep(live={"r2"}) == 0  # r1, r3 gone: the grace starts now
    clock.now += 4.9
    assert ledger.sweep(live={"r2"}) == 0
    clock.now += 0.1
    assert ledger.sweep(live={"r2"}) == 2
    got = {r["request_id"]: r for r in lines(ledger)}
    assert set(got) == {"r1", "r3"}
    r1, r3 = got["r1"], got["r3"]
    assert (r1["tenant"], r1["model"], r1["prompt_tokens"], r1["output_tokens"]) == (
        "a",
        "base",
        11,
        6,
    )
    assert (r1["finish_reason"], r1["recorded_by"], r1["replica"]) == (
        "ingress_lost",
        "controller",
        "rep-1",
    )
    assert (r3["output_tokens"], r3["moves"], r3["replica"]) == (4 + 3, 1, "rep-2")
    # the ingress's record, late after all: not counted twice
    ledger.record([sent(record(1, request_id="r1"))])
    assert len(lines(ledger)) == 2
    # r2 (an adapter's) ends later, never recorded by an ingress
    assert ledger.sweep(live=set()) == 0
    clock.now += 5
    assert ledger.sweep(live=set()) == 1
    assert lines(ledger)[-1]["model"] == "sql"


def test_a_restarted_controller_drops_records_it_wrote_before(tmp_path):
    spec = UsageSpec(str(tmp_path / "u.jsonl"))
    first = UsageLedger(spec, "base")
    first.record([sent(record(1, request_id="r1")), sent(record(2, request_id="r2"))])
    first.close()
    restarted = UsageLedger(spec, "base")  # Ray retries the submission that carried them
    restarted.record([sent(record(1, request_id="r1")), sent(record(3, request_id="r3"))])
    assert [r["request_id"] for r in lines(restarted)] == ["r1", "r2", "r3"]
