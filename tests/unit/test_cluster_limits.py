"""The controller's cluster-wide tenant limits (deployments/cluster/limits.py): the same rule
as one ingress's (policies.quota.refusal), over every request of the cluster."""

from __future__ import annotations

import pickle

import pytest

from fairbatch.deployments.cluster.limits import ClusterLimits, LimitsSpec, TenantLimit
from fairbatch.policies.quota import Rejected


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_quota_refuses_once_the_bucket_is_spent_and_says_when_it_refills():
    clock = Clock()
    lim = ClusterLimits(LimitsSpec({"a": TenantLimit(tokens_per_minute=600)}), clock)
    assert lim.admit("a", 500) is None
    lim.charge("a", 100)  # output reported by the replicas: the bucket is at 0
    r = lim.admit("a", 10)
    assert isinstance(r, Rejected) and (r.status, r.code) == (429, "quota_exceeded")
    assert r.retry_after == 1  # 600/min refills 10/s: positive again after any wait
    lim.charge("a", 95)  # in debt: 95 tokens at 10/s
    assert lim.admit("a", 1).retry_after == 10
    clock.t += 9.6
    assert lim.admit("a", 1) is None  # 96 refilled: level 1 > 0
    assert lim.rejected["a"] == 2 and lim.in_flight["a"] == 2
    assert lim.admit("b", 10**9) is None  # no quota for b


def test_in_flight_bounds_per_tenant_and_in_total():
    spec = LimitsSpec({"a": TenantLimit(max_requests=2)}, max_requests_per_tenant=3,
                      max_requests_total=5)  # fmt: skip
    lim = ClusterLimits(spec, Clock())
    assert [lim.admit("a", 1) for _ in range(2)] == [None, None]
    r = lim.admit("a", 1)
    assert (r.status, r.code) == (429, "tenant_queue_full") and "the limit is 2" in r.message
    assert [lim.admit("b", 1) for _ in range(3)] == [None] * 3
    assert lim.admit("b", 1).code == "tenant_queue_full"  # the default bound, 3
    lim.ended("a")
    assert lim.admit("c", 1) is None  # 5 in flight now
    r = lim.admit("a", 1)
    assert (r.status, r.code) == (503, "server_busy")
    lim.ended("b")
    assert lim.admit("a", 1) is None
    assert lim.total == 5 and dict(lim.in_flight) == {"a": 2, "b": 2, "c": 1}


def test_a_changed_quota_keeps_the_debt_and_a_cleared_one_admits():
    clock = Clock()
    lim = ClusterLimits(LimitsSpec({"a": TenantLimit(tokens_per_minute=60)}), clock)
    assert lim.admit("a", 120) is None  # level -60
    lim.set_tenant("a", TenantLimit(tokens_per_minute=6000))
    assert lim.admit("a", 1).retry_after == 1  # 100/s refills 60 in 0.6 s
    assert lim.limit("a") == TenantLimit(6000.0, None)
    lim.set_tenant("a", TenantLimit(None, 4))
    assert lim.admit("a", 1) is None and lim.bound("a") == 4


def test_a_refusal_crosses_processes_whole():
    r = Rejected(429, "quota_exceeded", "over", 7)
    back = pickle.loads(pickle.dumps(r))
    assert (back.status, back.code, back.message, back.retry_after, str(back)) == (
        429, "quota_exceeded", "over", 7, "over",
    )  # fmt: skip


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="tokens_per_minute"):
        TenantLimit(tokens_per_minute=0)
    with pytest.raises(ValueError, match="max_requests"):
        TenantLimit(max_requests=0)
