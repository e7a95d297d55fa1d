"""Goodput within deadline (`bench serve`): which requests count, per second of the window,
what the client sends, the deadlines scenario's shape, and edf as a local server setting."""

from __future__ import annotations

import argparse
import asyncio
import json

import httpx
import pytest

from fairbatch.benchmarks.serve_bench import engine_settings, request_rows
from fairbatch.benchmarks.serve_client import send_one
from fairbatch.benchmarks.serve_metrics import deadline_report, met_deadline, summarize_run
from fairbatch.benchmarks.serve_report import throughput_line
from fairbatch.benchmarks.serve_scenarios import DEADLINE_UNITS, build_scenario
from fairbatch.benchmarks.serve_types import RequestResult, RequestSpec


def result(
    timeout: float | None,
    e2e: float,
    finish: str = "length",
    ok: bool = True,
    tenant: str = "a",
    send: float = 1.0,
    tokens: int = 5,
) -> RequestResult:
    spec = RequestSpec(0, tenant, send, "x", 10, 5, timeout=timeout)
    first = send + min(e2e, 0.1)
    return RequestResult(
        spec,
        ok=ok,
        status=200 if ok else 0,
        send_s=send,
        first_token_s=first if tokens else None,
        end_s=send + e2e,
        chunk_times_s=[first] if tokens else [],
        completion_tokens=tokens,
        finish_reason=finish if ok else "",
    )


def test_a_request_meets_its_deadline_only_completed_in_time_and_not_evicted():
    assert met_deadline(result(2.0, 1.5))
    assert met_deadline(result(2.0, 2.0))  # at the deadline: in time
    assert met_deadline(result(2.0, 1.0, finish="stop"))
    assert not met_deadline(result(2.0, 2.5))  # late: the server did not evict it
    assert not met_deadline(result(2.0, 1.0, finish="timeout"))  # evicted: never good
    assert not met_deadline(result(2.0, 1.0, ok=False))  # failed, or cut off
    assert not met_deadline(result(None, 1.0))  # no deadline: not counted


def test_deadline_report_counts_and_goodput_per_second_of_the_window():
    results = [
        result(2.0, 1.0),
        result(2.0, 1.9, finish="stop"),
        result(2.0, 3.0),  # late
        result(2.0, 2.0, finish="timeout"),  # evicted with its tokens so far
        result(2.0, 0.5, finish="timeout", tokens=0),  # evicted before its first token
        result(2.0, 2.0, ok=False),  # failed
        result(None, 1.0),  # no deadline: in no count
    ]
    assert deadline_report(results, 4.0) == {
        "window_s": 4.0,
        "with_deadline": 6,
        "met": 2,
        "timed_out": 2,
        "timed_out_running": 1,
        "late": 1,
        "goodput_rps": 0.5,
    }
    with pytest.raises(ValueError, match="window_s"):
        deadline_report(results, 0.0)


def test_summarize_run_reports_deadlines_over_the_window_only_when_some_were_set():
    results = [result(2.0, 1.0, tenant="a"), result(2.0, 3.0, tenant="b", send=2.0)]
    run = summarize_run(results, duration_s=5.0, weights={"a": 1.0, "b": 1.0}, window_s=2.0)
    assert run["deadlines"]["met"] == 1 and run["deadlines"]["goodput_rps"] == 0.5
    run = summarize_run(results, duration_s=5.0, weights={})
    assert run["deadlines"]["window_s"] == 5.0  # default: the run's duration
    assert "within deadline: 1 of 2 (0 timed out, 1 late): 0.20 req/s" in throughput_line(run)
    plain = [result(None, 1.0)]
    assert "deadlines" not in summarize_run(plain, duration_s=5.0, weights={})


def test_the_deadlines_scenario_gives_every_request_a_tight_or_loose_deadline():
    capacity = 4.0
    scn = build_scenario("deadlines", capacity_rps=capacity, duration_s=30.0, seed=3)
    again = build_scenario("deadlines", capacity_rps=capacity, duration_s=30.0, seed=3)
    assert scn.requests == again.requests  # seeded
    timeouts = {r.timeout for r in scn.requests}
    assert timeouts == {round(u / capacity, 3) for u in DEADLINE_UNITS}
    assert all(r.max_queue_time_s == r.timeout / 2 for r in scn.requests)
    assert scn.offered_load() == pytest.approx(2.0, rel=0.3)  # 2x overload, A and B alike
    assert scn.offered_load("A") == pytest.approx(1.0, rel=0.35)
    assert request_rows([result(2.0, 1.0)])[0]["timeout"] == 2.0


def test_engine_settings_pass_edf_as_a_policy_kwarg():
    args = argparse.Namespace(
        policy="weighted_fair", max_num_seqs=4, num_gpu_blocks=None, preemption_mode="auto"
    )
    assert "policy_kwargs" not in engine_settings(args)
    args.order_within_tenant = "edf"
    assert engine_settings(args)["policy_kwargs"] == {"order_within_tenant": "edf"}
    eng = engine_settings(args, policy="fcfs", order_within_tenant="fcfs")
    assert eng["policy"] == "fcfs" and "policy_kwargs" not in eng


@pytest.mark.parametrize("send", [True, False])
def test_the_client_sends_a_specs_deadlines_unless_told_not_to(send):
    bodies: list[dict] = []

    def reply(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        chunk = {"choices": [{"text": " a", "finish_reason": "timeout"}]}
        return httpx.Response(200, text=f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n")

    spec = RequestSpec(0, "a", 0.0, "x", 1, 4, timeout=2.5, max_queue_time_s=1.25)

    async def go() -> RequestResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(reply)) as client:
            return await send_one(
                client, "http://x", spec, model="m", api_key=None, t0=0.0, timeout_s=5.0,
                send_deadlines=send,
            )  # fmt: skip

    res = asyncio.run(go())
    assert res.ok and res.finish_reason == "timeout" and not met_deadline(res)
    sent = {k: bodies[0][k] for k in ("timeout", "max_queue_time_s") if k in bodies[0]}
    assert sent == ({"timeout": 2.5, "max_queue_time_s": 1.25} if send else {})
