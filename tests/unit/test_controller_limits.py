"""FairnessCore with cluster-wide limits (ControllerConfig.limits): requests from any number
of ingresses are counted together; refused ones never enter the queue; output is charged to a
quota as the replicas report it."""

from __future__ import annotations

import dataclasses

from fairbatch.deployments.cluster.fairness import (
    Assign,
    ControllerConfig,
    FairnessCore,
    Refuse,
)
from fairbatch.deployments.cluster.limits import LimitsSpec, TenantLimit
from fairbatch.deployments.cluster.wire import ReplicaReport, RequestMeta
from fairbatch.engine.sampling_params import SamplingParams


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def meta(rid: str, tenant: str = "a", n: int = 10, consumer: str = "ingress-0") -> RequestMeta:
    return RequestMeta(
        rid, list(range(1, n + 1)), SamplingParams(max_tokens=n, ignore_eos=True),
        tenant=tenant, consumer=consumer,
    )  # fmt: skip


def report(seq: int, finished=(), active=None, service=None, seats=8) -> ReplicaReport:
    return ReplicaReport(
        replica_id="r0", seq=seq, max_num_seqs=seats, free_blocks=100, total_blocks=100,
        block_size=16, num_waiting=0, num_running=0, num_swapped=0, num_steps=0,
        service=service or {}, finished=list(finished), active=active or {},
    )  # fmt: skip


def core_with(limits: LimitsSpec, clock=None) -> FairnessCore:
    core = FairnessCore(ControllerConfig(limits=limits), clock=clock or Clock())
    core.report(report(1))
    return core


def kinds(actions) -> list[str]:
    return [type(a).__name__ for a in actions]


def test_in_flight_bound_counts_every_ingress_and_frees_on_finish():
    core = core_with(LimitsSpec({"a": TenantLimit(max_requests=3)}))
    got = [core.submit(meta(f"q{i}", consumer=f"ingress-{i % 2}")) for i in range(4)]
    assert [kinds(a) for a in got] == [["Assign"]] * 3 + [["Refuse"]]
    refused = got[3][0]
    assert refused.request_id == "q3" and refused.rejected.code == "tenant_queue_full"
    assert "q3" not in core.tickets and core.limits.in_flight["a"] == 3
    core.report(report(2, finished=[("q0", 10)]))  # one ended: its seat is free again
    assert kinds(core.submit(meta("q4", consumer="ingress-1"))) == ["Assign"]
    core.cancel("q4")  # a cancel before its replica saw it frees it at once
    assert core.limits.in_flight["a"] == 2
    assert kinds(core.submit(meta("q5"))) == ["Assign"]
    assert kinds(core.submit(meta("q6"))) == ["Refuse"]
    # a resubmission (its replica died under it) was admitted before: never refused
    again = dataclasses.replace(meta("q7"), attempt=1)
    assert isinstance(core.submit(again)[0], Assign)
    assert core.limits.in_flight["a"] == 4 and core.limits.total == 4


def test_quota_charges_prompts_at_admission_and_output_as_reported():
    clock = Clock()
    core = core_with(LimitsSpec({"a": TenantLimit(tokens_per_minute=60)}), clock)  # 1 tok/s
    assert kinds(core.submit(meta("q0", n=50))) == ["Assign"]  # 50 of 60 charged
    # the replica reports q0's 9 output tokens so far: level 60 - 50 - 9 = 1
    core.report(report(2, active={"q0": ("a", 0, True, 50, 9)}))
    assert kinds(core.submit(meta("q1", n=1))) == ["Assign"]  # level 0 now
    refused = core.submit(meta("q2", n=1))
    assert kinds(refused) == ["Refuse"] and refused[0].rejected.code == "quota_exceeded"
    core.report(report(3, active={"q0": ("a", 0, True, 50, 20), "q1": ("a", 0, True, 1, 0)}))
    refused = core.submit(meta("q3", n=1))  # 11 more reported: in debt by 11, at 1 token/s
    assert refused[0].rejected.retry_after == 11
    core.report(report(4, finished=[("q0", 20)], active={"q1": ("a", 0, True, 1, 0)}))
    assert core.submit(meta("q3b", n=1))[0].rejected.retry_after == 11  # q0 charged once
    clock.t += 11.5
    assert kinds(core.submit(meta("q4", n=1))) == ["Assign"]
    assert core.limits.rejected["a"] == 3
    assert kinds(core.submit(meta("b0", tenant="b", n=500))) == ["Assign"]  # b: no quota


def test_total_bound_answers_503_and_a_changed_limit_applies_at_once():
    core = core_with(LimitsSpec(max_requests_per_tenant=10, max_requests_total=2))
    assert kinds(core.submit(meta("q0"))) == ["Assign"]
    assert kinds(core.submit(meta("b0", tenant="b"))) == ["Assign"]
    r = core.submit(meta("c0", tenant="c"))[0]
    assert isinstance(r, Refuse) and r.rejected.status == 503
    core.limits.set_tenant("a", TenantLimit(tokens_per_minute=6))
    core.report(report(2, finished=[("b0", 10)]))
    assert kinds(core.submit(meta("q1", n=8))) == ["Assign"]  # a new bucket starts full
    assert core.submit(meta("q2", n=1))[0].rejected.code == "quota_exceeded"  # 6 - 8 < 0
    assert core.limits.limit("a") == TenantLimit(6.0, None)


def test_a_restarted_controller_counts_what_its_replicas_hold():
    core = FairnessCore(
        ControllerConfig(limits=LimitsSpec({"a": TenantLimit(max_requests=2)})), clock=Clock()
    )
    held = {"x": ("a", 0, True, 10, 3), "y": ("a", 0, True, 10, 0)}
    core.report(report(1, active=held, service={"a": (20, 3)}))
    assert core.limits.in_flight["a"] == 2
    assert kinds(core.submit(meta("q0"))) == ["Refuse"]
    core.report(report(2, finished=[("x", 10)], active={"y": held["y"]}))
    assert kinds(core.submit(meta("q1"))) == ["Assign"]


def test_a_request_its_client_saw_end_stops_counting_before_the_report():
    core = core_with(LimitsSpec({"a": TenantLimit(max_requests=2)}))
    for i in range(2):
        assert kinds(core.submit(meta(f"q{i}"))) == ["Assign"]
    assert kinds(core.submit(meta("q2"))) == ["Refuse"]
    core.client_ended([("q0", 10), ("gone", 3)])  # told with the client's next submission
    assert kinds(core.submit(meta("q3"))) == ["Assign"]
    core.client_ended([("q0", 10)])  # counted out once
    core.report(report(2, finished=[("q0", 10)]))  # the report then finds it: not again
    assert core.limits.in_flight["a"] == 2 and "q0" not in core.tickets
    assert kinds(core.submit(meta("q4"))) == ["Refuse"]


def test_a_client_that_saw_its_output_is_charged_before_the_report():
    clock = Clock()
    core = core_with(LimitsSpec({"a": TenantLimit(tokens_per_minute=60)}), clock)
    assert kinds(core.submit(meta("q0", n=20))) == ["Assign"]  # level 40
    core.client_ended([("q0", 40)])  # all 40 of its output seen: level 0
    assert core.submit(meta("q1", n=1))[0].rejected.code == "quota_exceeded"
    core.report(report(2, finished=[("q0", 40)]))  # charged once
    clock.t += 1.5
    assert kinds(core.submit(meta("q2", n=1))) == ["Assign"]
    # a resubmission's output from before the replica died was charged on the first attempt
    again = dataclasses.replace(meta("q3", n=1), attempt=1, output_ids=[5] * 30)
    core.submit(again)
    core.report(report(3, active={"q3": ("a", 0, True, 31, 31)}))
    clock.t += 1.0  # level 1.5 - 1 (q2) + 1 - 1 (q3's one new token) = 0.5
    assert kinds(core.submit(meta("q4", n=1))) == ["Assign"]


def test_limits_set_on_a_running_controller_count_what_it_holds():
    core = FairnessCore(ControllerConfig(), clock=Clock())
    core.report(report(1))
    for i in range(3):
        core.submit(meta(f"q{i}"))
    core.set_limits(LimitsSpec({"a": TenantLimit(max_requests=3)}))
    assert core.limits.in_flight["a"] == 3
    assert kinds(core.submit(meta("q3"))) == ["Refuse"]
    core.set_limits(LimitsSpec({"a": TenantLimit(max_requests=4)}))  # counts stay
    assert kinds(core.submit(meta("q4"))) == ["Assign"]
    assert kinds(core.submit(meta("q5"))) == ["Refuse"]


def test_a_cluster_keeps_its_identity_when_only_limits_change():
    from fairbatch.deployments.cluster.launch import ClusterSpec

    a = ClusterSpec("c", [], ControllerConfig(limits=LimitsSpec({"a": TenantLimit(60)})))
    b = ClusterSpec("c", [], ControllerConfig(limits=LimitsSpec(max_requests_total=9)))
    c = ClusterSpec("c", [], ControllerConfig(local_queue=5))
    assert a.cluster_id() == b.cluster_id() != c.cluster_id()
