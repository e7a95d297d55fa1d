"""Deadlines in the controller's logic (FairnessCore, no Ray): queued tickets past their queue
deadline leave with "timeout" and are never assigned; deadlines cross clocks as wall-clock
time; edf orders a tenant's tickets without changing the tenants' order."""

from __future__ import annotations

import math

from fairbatch.deployments.cluster.fairness import ControllerConfig, Expire, FairnessCore
from fairbatch.deployments.cluster.wire import RequestMeta
from fairbatch.engine.sampling_params import SamplingParams
from fairbatch.policies import TenantSpec
from tests.ray.test_fairness_core import Reporter, assigned


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def meta(rid: str, tenant: str = "a", wall: float = 1000.0, **deadlines) -> RequestMeta:
    """A request that arrived at wall-clock time `wall` with `timeout` / `max_queue_time_s`."""
    params = SamplingParams(max_tokens=10, ignore_eos=True, **deadlines)
    m = RequestMeta(rid, list(range(1, 11)), params, tenant=tenant)
    m.set_deadlines(wall)
    return m


def make(policy_kwargs=None, tenants=()):
    # the controller's monotonic clock reads 5 when the wall clock reads 1000
    clock, wall = Clock(5.0), Clock(1000.0)
    config = ControllerConfig(
        local_queue=0, tenants=list(tenants), policy_kwargs=dict(policy_kwargs or {})
    )
    core = FairnessCore(config, clock=clock, wall=wall)
    return core, clock, wall


def expired(actions) -> list[str]:
    return [a.ticket.request_id for a in actions if isinstance(a, Expire)]


def test_a_queued_ticket_past_its_queue_deadline_leaves_and_is_never_assigned():
    core, clock, wall = make()
    rep = Reporter("r0", seats=1)
    core.report(rep())
    assert assigned(core.submit(meta("run"))) == [("run", "r0")]
    core.submit(meta("late", max_queue_time_s=2.0))
    core.submit(meta("next"))
    t = core.tickets["late"]
    assert t.queue_deadline == 7.0 and t.deadline == math.inf  # 1002 wall = 7 here
    clock.now, wall.now = 6.9, 1001.9
    assert core.expire() == []
    clock.now, wall.now = 7.0, 1002.0
    actions = core.report(rep(finished=[("run", 10)]))  # a seat frees as the deadline passes
    assert expired(actions) == ["late"] and actions[0].finish_reason == "timeout"
    assert assigned(actions) == [("next", "r0")]  # the seat goes to the next, not to "late"
    assert "late" not in core.tickets and core.timed_out == {"a": 1}
    assert core.stats()["queued"] == 0
    # never assigned, so never prepaid: only "run" and "next" are (10 prompt + 2 x 10 output)
    assert core.counters()["a"] == 60.0


def test_the_total_deadline_also_drops_a_queued_ticket_and_an_assigned_one_stays():
    core, clock, wall = make()
    rep = Reporter("r0", seats=1)
    core.report(rep())
    core.submit(meta("run", timeout=1.0))
    core.submit(meta("queued", timeout=1.0))
    clock.now = 6.0
    assert expired(core.expire()) == ["queued"]
    assert core.where("run") == "r0"  # its replica ends it: replicas enforce running deadlines


def test_a_resubmission_keeps_its_original_deadline_in_another_clock():
    m = meta("r", max_queue_time_s=3.0, timeout=10.0, wall=1000.0)
    assert (m.deadline, m.queue_deadline) == (1010.0, 1003.0)
    # the replica died; a restarted controller (monotonic clock at 50, wall clock 1001) sees
    # the same meta again: 2 s of queue time are left, not 3
    clock, wall = Clock(50.0), Clock(1001.0)
    core = FairnessCore(ControllerConfig(local_queue=0), clock=clock, wall=wall)
    m.attempt = 1
    core.submit(m)
    assert (core.tickets["r"].queue_deadline, core.tickets["r"].deadline) == (52.0, 59.0)
    clock.now = 52.0
    assert expired(core.dispatch()) == ["r"]


def test_edf_orders_a_tenants_queue_and_the_tenants_stay_fair():
    tenants = [TenantSpec("a"), TenantSpec("b")]
    core, clock, wall = make({"order_within_tenant": "edf"}, tenants)
    for rid, tenant, timeout in [
        ("a1", "a", 50.0),
        ("a2", "a", 20.0),
        ("a3", "a", None),
        ("b1", "b", 40.0),
        ("b2", "b", 10.0),
    ]:
        core.submit(meta(rid, tenant, timeout=timeout))
    rep = Reporter("r0", seats=1)
    order = assigned(core.report(rep()))
    for _ in range(4):
        done = order[-1][0]
        order += assigned(core.report(rep(finished=[(done, 10)])))
    got = [rid for rid, _ in order]
    assert [r for r in got if r[0] == "a"] == ["a2", "a1", "a3"]
    assert [r for r in got if r[0] == "b"] == ["b2", "b1"]
    assert got[:4] in (["a2", "b2", "a1", "b1"], ["b2", "a2", "b1", "a1"])  # alternating
