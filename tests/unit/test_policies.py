"""Tests for fairbatch.policies: exact pop orders computed by hand, plus a reference model."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fairbatch
from fairbatch.policies import POLICIES, Policy, TenantSpec, make_policy
from fairbatch.policies.fcfs import FcfsPolicy
from fairbatch.policies.priority import PriorityPolicy
from fairbatch.policies.round_robin import RoundRobinPolicy
from fairbatch.policies.weighted_fair import WeightedFairPolicy


class Req:
    """Stand-in for scheduler.request.Request with only what policies read."""

    __slots__ = ("request_id", "tenant", "priority", "arrival_time", "seq", "num_prompt_tokens")

    def __init__(
        self, request_id: str, tenant: str, seq: int, priority: int = 0, arrival_time: float = 0.0
    ) -> None:
        self.request_id = request_id
        self.tenant = tenant
        self.seq = seq
        self.priority = priority
        self.arrival_time = arrival_time
        self.num_prompt_tokens = 1

    def __repr__(self) -> str:
        return self.request_id


def mk(*names: str, priority: int = 0, arrival_time: float = 0.0, first_seq: int = 1) -> list[Req]:
    """Requests named like 'a1': tenant = first letter, seq = position (from first_seq)."""
    return [
        Req(name, name[0], first_seq + i, priority, arrival_time) for i, name in enumerate(names)
    ]


def drain(policy: Policy) -> list[str]:
    """Pop until peek() is None; the ids in pop order."""
    out = []
    while policy.peek() is not None:
        out.append(policy.pop().request_id)
    return out


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# ---- fcfs ------------------------------------------------------------------------------------


def test_fcfs_orders_by_seq_across_tenants_requeued_first() -> None:
    p = FcfsPolicy()
    s1, s2, s3, s4, s5 = mk("a1", "b1", "a2", "c1", "b2")
    for r in (s4, s2, s1, s5, s3):  # enqueue order must not matter: seq decides
        p.enqueue(r)
    assert [p.pop().request_id, p.pop().request_id] == ["a1", "b1"]
    p.requeue(s2)  # requeued in reverse seq order: still served by seq, before fresh ones
    p.requeue(s1)
    assert drain(p) == ["a1", "b1", "a2", "c1", "b2"]
    assert len(p) == 0


def test_fcfs_with_real_request_objects() -> None:
    from fairbatch.scheduler.request import Request

    reqs = [Request(f"r{i}", [1, 2], 4, tenant=t) for i, t in enumerate("xyx")]
    for seq, r in enumerate(reqs, start=1):
        r.seq = seq
    p = make_policy("fcfs")
    for r in reversed(reqs):
        p.enqueue(r)
    assert drain(p) == ["r0", "r1", "r2"]


# ---- round robin -----------------------------------------------------------------------------


def test_round_robin_three_tenants_cycles_in_registration_order() -> None:
    p = RoundRobinPolicy([TenantSpec("a"), TenantSpec("b"), TenantSpec("c")])
    for r in mk("c1", "a1", "a2", "b1", "c2", "a3"):
        p.enqueue(r)
    # a (first registered), b, c, a, (b empty) c, a.
    assert drain(p) == ["a1", "b1", "c1", "a2", "c2", "a3"]
    # The cycle continues after a: b is empty, so c goes before a.
    for r in mk("a4", "c3", first_seq=7):
        p.enqueue(r)
    assert drain(p) == ["c3", "a4"]


def test_round_robin_requeue_goes_first_within_tenant_without_moving_the_cycle() -> None:
    p = RoundRobinPolicy([TenantSpec("a"), TenantSpec("b")])
    a1, b1, a2, b2 = mk("a1", "b1", "a2", "b2")
    for r in (a1, b1, a2, b2):
        p.enqueue(r)
    assert p.pop() is a1
    p.requeue(a1)  # next turn is b's; a1 comes back ahead of a2
    assert drain(p) == ["b1", "a1", "b2", "a2"]


# ---- weighted fair ---------------------------------------------------------------------------


def test_weighted_fair_weights_3_to_1_exact_sequence() -> None:
    p = WeightedFairPolicy([TenantSpec("a", weight=3), TenantSpec("b", weight=1)])
    for r in mk("a1", "b1", "a2", "b2", "a3", "b3", "a4", "b4", "a5", "b5", "a6", "b6"):
        p.enqueue(r)
    # Every served request is charged 3 decode tokens = 6 weighted tokens: a += 2, b += 6.
    # (a, b) counters before each pop -> choice:
    # (0,0) tie, a1 seq 1 < b1 seq 2 -> a1 | (2,0) b1 | (2,6) a2 | (4,6) a3
    # (6,6) tie, b2 seq 4 < a4 seq 7 -> b2 | (6,12) a4 | (8,12) a5 | (10,12) a6
    order = []
    for _ in range(8):
        r = p.pop()
        order.append(r.request_id)
        p.charge(r.tenant, 0, 3)
    assert order == ["a1", "b1", "a2", "a3", "b2", "a4", "a5", "a6"]
    assert p.counters() == {"a": 12.0, "b": 12.0}
    assert p.service() == {"a": 36.0, "b": 12.0}  # 3:1


def test_weighted_fair_charge_uses_input_and_output_weights() -> None:
    p = WeightedFairPolicy([TenantSpec("a", weight=2)], input_weight=0.5, output_weight=4.0)
    p.charge("a", 10, 3)  # 0.5*10 + 4*3 = 17
    p.charge("new", 2, 0)  # unknown tenants are registered on the fly
    assert p.service() == {"a": 17.0, "new": 1.0}
    assert p.counters() == {"a": 8.5, "new": 1.0}
    p.update_tenant("a", weight=1)  # applies to later charges only
    p.charge("a", 0, 1)
    assert p.counters()["a"] == 12.5


def test_vtc_lift_to_min_backlogged_counter() -> None:
    p = WeightedFairPolicy()
    a1, b1, c1, d1 = mk("a1", "b1", "c1", "d1")
    p.enqueue(a1)
    p.enqueue(b1)
    p.charge("a", 10, 0)
    p.charge("b", 4, 0)
    p.charge("c", 1, 0)  # c was served earlier, then idled
    p.charge("d", 20, 0)
    p.enqueue(c1)  # c becomes backlogged: lifted from 1 to min(a=10, b=4) = 4
    p.enqueue(d1)  # d is above the min: keeps 20
    assert p.counters() == {"a": 10.0, "b": 4.0, "c": 4.0, "d": 20.0}
    # Without the lift c1 (counter 1) would go first.
    assert drain(p) == ["b1", "c1", "a1", "d1"]


def test_vtc_lift_without_backlog_uses_last_served_counter() -> None:
    p = WeightedFairPolicy()
    a1, a2, b1, c1 = mk("a1", "a2", "b1", "c1")
    p.enqueue(a1)
    assert p.pop() is a1
    p.charge("a", 5, 0)
    p.enqueue(b1)  # nobody backlogged: b lifted to a's counter (a was served last)
    assert p.counters()["b"] == 5.0
    p.enqueue(a2)  # a's own 5 is not below min backlogged (b=5)
    p.requeue(c1)  # requeue never lifts
    assert p.counters() == {"a": 5.0, "b": 5.0, "c": 0.0}
    assert drain(p) == ["c1", "a2", "b1"]


def test_weighted_fair_requeue_goes_ahead_of_tenant_in_seq_order() -> None:
    p = WeightedFairPolicy()
    a1, a2, a3, a4 = mk("a1", "a2", "a3", "a4")
    for r in (a1, a2, a3, a4):
        p.enqueue(r)
    assert p.pop() is a1
    assert p.pop() is a2
    p.requeue(a2)
    p.requeue(a1)
    assert [r.request_id for r in (p.pop(), p.pop(), p.pop(), p.pop())] == ["a1", "a2", "a3", "a4"]


def test_set_counters_reorders_also_downwards() -> None:
    p = WeightedFairPolicy()
    a1, b1 = mk("a1", "b1")
    p.enqueue(a1)
    p.enqueue(b1)
    assert p.peek() is a1  # tie, lower seq
    p.set_counters({"a": 5.0})
    assert p.peek() is b1
    p.set_counters({"a": 0.0, "b": 7.0})
    assert p.peek() is a1
    p.set_counters({"z": 3.0})
    assert p.counters() == {"a": 0.0, "b": 7.0, "z": 3.0}
    assert p.service() == {"a": 0.0, "b": 0.0, "z": 0.0}  # service is not touched


def test_set_counters_lowering_a_buried_tenant() -> None:
    p = WeightedFairPolicy()
    a1, b1, c1 = mk("a1", "b1", "c1")
    for r in (a1, b1, c1):
        p.enqueue(r)
    p.set_counters({"a": 5.0, "b": 3.0, "c": 4.0})
    assert p.peek() is b1
    p.set_counters({"a": 0.0})  # a was last in line; now it is first
    assert drain(p) == ["a1", "b1", "c1"]


# ---- queue mechanics -------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_remove_from_the_middle_and_head(name: str) -> None:
    p = make_policy(name)
    reqs = mk("a1", "a2", "a3", "a4", "a5")
    for r in reqs:
        p.enqueue(r)
    assert p.remove(reqs[2]) is True
    assert p.remove(reqs[2]) is False
    assert reqs[2] not in p and reqs[3] in p
    assert len(p) == 4
    assert p.peek() is reqs[0]
    assert p.remove(reqs[0]) is True  # the cached head
    assert p.peek() is reqs[1]
    assert drain(p) == ["a2", "a4", "a5"]
    assert p.remove(reqs[4]) is False


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_peek_tenant_is_the_tenants_next_request_in_policy_order(name: str) -> None:
    """Differential: with other tenants queued too, `peek_tenant(t)` is what `peek()` of the
    same policy holding only t's requests answers (classes, requeues and removals included)."""
    mixed, alone = make_policy(name), make_policy(name)
    reqs = mk("a1", "b2", "a3", "b4", "a5", "c6")
    reqs += [Req("a7", "a", 7, priority=1), Req("b8", "b", 8, priority=2)]
    for r in reqs:
        mixed.enqueue(r)
        if r.tenant == "a":
            alone.enqueue(r)
    requeued = Req("a0", "a", 0)
    mixed.requeue(requeued)
    alone.requeue(requeued)
    while alone.peek() is not None:
        head = alone.peek()
        assert mixed.peek_tenant("a") is head
        alone.remove(head, served=True)
        mixed.remove(head, served=True)
    assert mixed.peek_tenant("a") is None and mixed.peek_tenant("nobody") is None
    assert mixed.peek_tenant("c").request_id == "c6"


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_queue_basics(name: str) -> None:
    p = make_policy(name)
    with pytest.raises(IndexError):
        p.pop()
    assert p.peek() is None
    reqs = mk("a1", "b1", "a2")
    for r in reqs:
        p.enqueue(r)
    with pytest.raises(ValueError, match="already queued"):
        p.requeue(reqs[1])
    assert len(p) == 3
    assert list(p) == reqs  # insertion order
    for r in p:  # a snapshot: mutation while iterating is fine
        p.remove(r)
    assert len(p) == 0 and list(p) == []
    for r in reqs:  # removed requests may be queued again
        p.enqueue(r)
    head = p.peek()
    assert head is not None and p.peek() is head and p.pop() is head


def test_many_removals_compact_and_keep_order() -> None:
    p = WeightedFairPolicy()
    reqs = [Req(f"r{i}", "ab"[i % 2], i) for i in range(1000)]
    for r in reqs:
        p.enqueue(r)
    for r in reqs:
        if r.seq % 3:
            assert p.remove(r)
    # White-box: lazy deletion must not keep dead entries around without bound.
    for tq in p._order._queues.values():
        assert len(tq.items) <= 2 * tq.live + 64
    assert drain(p) == [r.request_id for r in reqs if r.seq % 3 == 0]
    assert len(p) == 0


def test_vtc_lift_sees_a_tenant_whose_quota_refilled_without_a_peek() -> None:
    clock = FakeClock()
    p = WeightedFairPolicy([TenantSpec("a", tokens_per_minute=60)], clock=clock)
    a1, b1, c1 = mk("a1", "b1", "c1")
    p.enqueue(a1)
    p.enqueue(b1)
    p.charge("b", 100, 0)
    p.charge("a", 61, 0)  # counter 61, bucket -1: throttled for 1 s
    assert p.peek() is b1
    clock.now = 2.0  # a is eligible again: backlogged {a: 61, b: 100}
    p.enqueue(c1)
    assert p.counters()["c"] == 61.0


# ---- priority --------------------------------------------------------------------------------


def test_priority_strict_classes_with_fcfs_inside() -> None:
    p = PriorityPolicy(inner="fcfs")
    (lo,) = mk("a1", priority=0)
    m1, m2 = mk("b1", "a2", priority=1, first_seq=2)
    (hi,) = mk("c1", priority=5, first_seq=4)
    for r in (lo, m1, m2, hi):
        p.enqueue(r)
    assert drain(p) == ["c1", "b1", "a2", "a1"]


def test_priority_weighted_fair_inside_a_class() -> None:
    p = make_policy("priority")  # inner weighted_fair
    a1, b1 = mk("a1", "b1", priority=1)
    (c1,) = mk("c1", priority=0, first_seq=3)
    for r in (c1, a1, b1):
        p.enqueue(r)
    assert p.peek() is a1  # equal counters: lower seq
    p.charge("a", 10, 0)  # charged while backlogged (a lift would have equalized it)
    assert drain(p) == ["b1", "a1", "c1"]  # class 1 first; inside it b has the lower counter


def test_priority_aging_with_fake_clock() -> None:
    clock = FakeClock()
    p = PriorityPolicy(inner="fcfs", aging_s=10.0, clock=clock)
    (low,) = mk("a1", priority=0, arrival_time=0.0)
    p.enqueue(low)
    clock.now = 25.0
    (high,) = mk("b1", priority=2, arrival_time=25.0, first_seq=2)
    p.enqueue(high)
    # low has waited 25 s: 0 + floor(25/10) = 2, equal to high's 2 + 0: the higher class wins.
    assert p.effective_priority(low) == 2.0 and p.effective_priority(high) == 2.0
    assert p.peek() is high
    clock.now = 29.5
    assert p.peek() is high
    clock.now = 30.0  # low reaches 3 > 2; no mutation happened, the cached answer must expire
    assert p.effective_priority(low) == 3.0
    assert p.peek() is low
    assert p.rank(low) < p.rank(high)
    assert drain(p) == ["a1", "b1"]


def test_priority_without_aging_never_promotes() -> None:
    clock = FakeClock()
    p = PriorityPolicy(inner="fcfs", clock=clock)
    (low,) = mk("a1", priority=0)
    (high,) = mk("b1", priority=2, first_seq=2)
    p.enqueue(low)
    p.enqueue(high)
    clock.now = 1e9
    assert p.effective_priority(low) == 0.0
    assert p.peek() is high


def test_aging_looks_at_the_oldest_request_of_a_class() -> None:
    clock = FakeClock(100.0)
    p = PriorityPolicy(inner="fcfs", aging_s=10.0, clock=clock)
    old, new = Req("a1", "a", 5, 0, 0.0), Req("b1", "b", 1, 0, 100.0)
    (high,) = mk("c1", priority=5, arrival_time=100.0, first_seq=9)
    for r in (old, new, high):
        p.enqueue(r)
    # Class 0's oldest waited 100 s -> 10 > 5: class 0 wins, and inside it fcfs picks b1 (seq 1).
    assert p.peek() is new
    # new itself has waited 0 s, but ranks with its class: ahead of high.
    assert p.effective_priority(new) == 0.0
    assert p.rank(new) < p.rank(high)
    assert drain(p) == ["b1", "a1", "c1"]


@pytest.mark.parametrize(
    ("name", "kw"),
    [("fcfs", {}), ("round_robin", {}), ("priority", {"inner": "fcfs"}), ("weighted_fair", {})],
)
def test_every_policy_skips_a_tenant_over_quota(name: str, kw: dict) -> None:
    clock = FakeClock()
    p = make_policy(name, [TenantSpec("a", tokens_per_minute=60)], clock=clock, **kw)
    a1, b1 = mk("a1", "b1")
    p.enqueue(a1)
    p.enqueue(b1)
    assert p.peek() is a1
    p.set_counters({"b": 61.0})  # so that weighted_fair would pick a1 too
    p.charge("a", 61, 0)  # bucket -1 (and a's counter 61: a tie, broken by seq, for a1)
    assert p.peek() is b1
    clock.now = 1.5
    assert p.peek() is a1


# ---- quotas ----------------------------------------------------------------------------------


def test_quota_skips_tenant_until_refill_and_retry_after_is_exact() -> None:
    clock = FakeClock()
    p = FcfsPolicy([TenantSpec("a", tokens_per_minute=60)], clock=clock)  # 1 token/s, cap 60
    a1, a2, b1 = mk("a1", "a2", "b1")
    for r in (a1, a2, b1):
        p.enqueue(r)
    assert p.pop() is a1
    p.charge("a", 50, 20)  # 70 raw tokens from 60: level -10
    assert not p.quota_eligible("a") and p.quota_eligible("b")
    assert p.retry_after("a") == 10.0 and p.retry_after("b") == 0.0
    assert p.peek() is b1  # a2 has the lower seq but a is over quota
    clock.now = 4.0
    assert p.retry_after("a") == 6.0
    assert p.pop() is b1
    assert p.peek() is None and len(p) == 1 and a2 in p
    with pytest.raises(IndexError):
        p.pop()
    clock.now = 10.5  # level 0.5 > 0; nothing changed in the queue, only time passed
    assert p.quota_eligible("a") and p.retry_after("a") == 0.0
    assert p.pop() is a2


def test_quota_bucket_caps_at_capacity_and_can_be_changed() -> None:
    clock = FakeClock()
    p = WeightedFairPolicy([TenantSpec("a", tokens_per_minute=120)], clock=clock)  # 2 tokens/s
    (a1,) = mk("a1")
    p.enqueue(a1)
    clock.now = 1000.0  # idle time refills only up to the capacity (120)
    p.charge("a", 121, 0)
    assert p.retry_after("a") == 0.5
    assert p.peek() is None
    p.update_tenant("a", tokens_per_minute=None)  # quota removed: eligible at once
    assert p.peek() is a1
    p.update_tenant("a", tokens_per_minute=60)  # a new quota starts with a full bucket
    assert p.retry_after("a") == 0.0 and p.peek() is a1
    p.charge("a", 61, 0)
    p.update_tenant("a", weight=2.0)  # other changes keep the bucket's level
    assert p.retry_after("a") == 1.0 and p.peek() is None


def test_tenant_spec_validation() -> None:
    with pytest.raises(ValueError):
        TenantSpec("a", weight=0)
    with pytest.raises(ValueError):
        TenantSpec("a", tokens_per_minute=0)
    p = FcfsPolicy()
    with pytest.raises(ValueError):
        p.update_tenant("a", weight=-1.0)
    assert p.tenant("a") == TenantSpec("a")  # the failed update registered defaults only


# ---- preemption ------------------------------------------------------------------------------


def test_pick_victim_priority_then_counter_then_latest_seq() -> None:
    p = FcfsPolicy()
    r1 = Req("r1", "a", 1, priority=1)
    r2 = Req("r2", "a", 2, priority=0)
    r3 = Req("r3", "b", 3, priority=0)
    r4 = Req("r4", "b", 4, priority=0)
    p.set_counters({"a": 5.0, "b": 10.0})
    assert p.pick_victim([r1, r2, r3, r4]) is r4  # prio 0; b over-served; latest seq
    assert p.pick_victim([r1, r2, r3]) is r3
    p.set_counters({"a": 20.0})
    assert p.pick_victim([r1, r2, r3, r4]) is r2
    assert p.pick_victim([r1]) is r1
    assert p.pick_victim([r1, r2], below_priority=1) is r2
    assert p.pick_victim([r1, r2], below_priority=0) is None
    assert p.pick_victim([]) is None


# ---- registry and isolation ------------------------------------------------------------------


def test_each_policy_declares_what_it_does() -> None:
    declared = {n: (c.wants_hit_length, c.preempts_lower_classes) for n, c in POLICIES.items()}
    assert declared == {
        "fcfs": (False, False),
        "round_robin": (False, False),
        "weighted_fair": (False, False),
        "priority": (False, True),
        "lpm": (True, False),
        "dlpm": (True, False),
    }
    for cls in POLICIES.values():  # every policy has a clock and KV shares
        clock = FakeClock()
        p = cls([TenantSpec("a", kv_share=0.5), TenantSpec("b")], clock=clock)
        assert p.clock is clock and p.kv_shares() == {"a": 0.5}
        assert cls().clock is time.monotonic


def test_no_caller_asks_a_policy_by_name_or_by_probing() -> None:
    """What a policy does is read from its declarations (above), never from its name."""
    root = Path(fairbatch.__file__).parent
    needles = ("getattr(policy", "hasattr(policy", "getattr(self.policy", "hasattr(self.policy")
    needles += ("policy.name ==", 'policy == "')
    for sub in ("scheduler", "policies", "kv", "deployments/cluster", "engine"):
        for path in (root / sub).rglob("*.py"):
            text = path.read_text()
            assert not [n for n in needles if n in text], path


def test_make_policy_registry() -> None:
    assert set(POLICIES) == {"fcfs", "round_robin", "weighted_fair", "priority", "lpm", "dlpm"}
    for name, cls in POLICIES.items():
        assert cls.name == name and isinstance(make_policy(name), cls)
    with pytest.raises(ValueError, match="unknown policy 'lottery'.*fcfs.*weighted_fair"):
        make_policy("lottery")
    p = make_policy("priority", [TenantSpec("a", weight=2)], inner="fcfs", aging_s=5.0)
    assert isinstance(p, PriorityPolicy) and p.aging_s == 5.0 and p.inner == "fcfs"
    assert p.tenant("a").weight == 2
    with pytest.raises(TypeError, match="aging_s"):
        make_policy("fcfs", aging_s=5.0)
    with pytest.raises(ValueError):
        make_policy("priority", inner="lottery")


def test_policies_import_neither_torch_nor_ray_nor_other_packages() -> None:
    # The directory that makes `fairbatch` importable here (a symlink farm or the checkout's
    # parent); an editable install is found through site-packages anyway.
    fbpath = str(Path(fairbatch.__file__).parent.parent)
    code = (
        "import fairbatch.policies, sys; "
        "assert 'torch' not in sys.modules and 'ray' not in sys.modules, 'torch/ray'; "
        "ours = [m for m in sys.modules if m.startswith('fairbatch.')]; "
        "assert all(m.startswith('fairbatch.policies') for m in ours), ours"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([fbpath, env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# ---- reference model -------------------------------------------------------------------------

TENANTS = ("a", "b", "c")
WEIGHTS = {"a": 1.0, "b": 2.0, "c": 4.0}
QUOTAS = {"b": 30.0}  # 0.5 token/s: integer ticks and tokens keep the arithmetic exact
AGING_S = 3

CONFIGS = {
    "fcfs": {},
    "round_robin": {},
    "weighted_fair": {},
    "priority": {"aging_s": AGING_S},
    "priority-fcfs": {"inner": "fcfs"},
}


class Model:
    """Recomputes every decision from a flat list, following the documented keys."""

    def __init__(self, config: str) -> None:
        self.kind = config.split("-")[0]
        self.inner_wf = config in ("weighted_fair", "priority")
        self.aging = CONFIGS[config].get("aging_s")
        self.queued: list[tuple[Req, int, int]] = []  # (req, 0 requeued | 1 fresh, insertion)
        self.inserted = 0
        self.counters = dict.fromkeys(TENANTS, 0.0)
        self.rates = dict.fromkeys(TENANTS, 0)  # requests decoding every step (add_decoding)
        self.levels = dict(QUOTAS)
        self.now = 0
        self.last_served: dict[int, str] = {}  # per class
        self.next_ring = 0

    def klass(self, req: Req) -> int:
        return req.priority if self.kind == "priority" else 0

    def eligible(self, tenant: str) -> bool:
        return tenant not in self.levels or self.levels[tenant] > 0

    def inner_key(self, item: tuple[Req, int, int]) -> tuple:
        req, flag, n = item
        if self.kind == "round_robin":
            return ((TENANTS.index(req.tenant) - self.next_ring) % len(TENANTS), flag, req.seq, n)
        if self.inner_wf:
            return (self.counters[req.tenant], flag, req.seq, n)
        return (flag, req.seq, n)

    def select(self) -> Req | None:
        classes: dict[int, list] = {}
        for item in self.queued:
            classes.setdefault(self.klass(item[0]), []).append(item)

        def class_key(c: int) -> tuple:
            if self.aging is None:
                return (c, c)
            oldest = min(item[0].arrival_time for item in classes[c])
            return (c + math.floor((self.now - oldest) / self.aging), c)

        for c in sorted(classes, key=class_key, reverse=True):
            ok = [item for item in classes[c] if self.eligible(item[0].tenant)]
            if ok:
                return min(ok, key=self.inner_key)[0]
        return None

    def insert(self, req: Req, flag: int) -> None:
        same = [item for item in self.queued if self.klass(item[0]) == self.klass(req)]
        if self.inner_wf and flag == 1 and not any(i[0].tenant == req.tenant for i in same):
            backlogged = [self.counters[i[0].tenant] for i in same if self.eligible(i[0].tenant)]
            last = self.last_served.get(self.klass(req))
            if backlogged:
                floor = min(backlogged)
            elif last is not None:
                floor = self.counters[last]
            else:
                floor = -math.inf
            self.counters[req.tenant] = max(self.counters[req.tenant], floor)
        self.inserted += 1
        self.queued.append((req, flag, self.inserted))

    def pop(self) -> Req | None:
        req = self.select()
        if req is not None:
            self.queued = [item for item in self.queued if item[0] is not req]
            self.last_served[self.klass(req)] = req.tenant
            self.next_ring = TENANTS.index(req.tenant) + 1
        return req

    def charge(self, tenant: str, prefill: int, decode: int) -> None:
        self.counters[tenant] += (prefill + 2 * decode) / WEIGHTS[tenant]
        if tenant in self.levels:
            self.levels[tenant] -= prefill + decode

    def tick(self, dt: int) -> None:
        self.now += dt
        for tenant, level in self.levels.items():
            self.levels[tenant] = min(QUOTAS[tenant], level + dt * QUOTAS[tenant] / 60)


OPS = st.one_of(
    st.tuples(st.just("enqueue"), st.sampled_from(TENANTS), st.integers(0, 2)),
    st.tuples(st.just("requeue"), st.integers(0, 1000)),
    st.tuples(st.just("pop")),
    st.tuples(st.just("pop")),
    st.tuples(st.just("remove"), st.integers(0, 1000)),
    st.tuples(st.just("charge"), st.sampled_from(TENANTS), st.integers(0, 40), st.integers(0, 8)),
    st.tuples(st.just("tick"), st.integers(0, 4)),
    st.tuples(st.just("set_counters"), st.sampled_from(TENANTS), st.integers(0, 60)),
    st.tuples(st.just("decoding"), st.sampled_from(TENANTS), st.sampled_from([1, 1, -1])),
    st.tuples(st.just("decode_step"), st.dictionaries(st.sampled_from(TENANTS), st.integers(0, 2))),
    st.tuples(st.just("decode_step"), st.just({})),
)


@pytest.mark.parametrize("config", sorted(CONFIGS))
@settings(max_examples=250, deadline=None)
@given(ops=st.lists(OPS, max_size=60))
def test_matches_reference_model(config: str, ops: list[tuple]) -> None:
    model = Model(config)
    clock = FakeClock()
    specs = [TenantSpec(t, weight=WEIGHTS[t], tokens_per_minute=QUOTAS.get(t)) for t in TENANTS]
    p = make_policy(model.kind, specs, clock=clock, **CONFIGS[config])
    out: list[Req] = []  # popped or removed, may be requeued
    seq = 0
    for op in ops:
        if op[0] == "enqueue":
            seq += 1
            req = Req(f"r{seq}", op[1], seq, priority=op[2], arrival_time=clock.now)
            p.enqueue(req)
            model.insert(req, 1)
        elif op[0] == "requeue" and out:
            req = out.pop(op[1] % len(out))
            p.requeue(req)
            model.insert(req, 0)
        elif op[0] == "pop":
            expected = model.pop()
            if expected is None:
                with pytest.raises(IndexError):
                    p.pop()
            else:
                assert p.pop() is expected
                out.append(expected)
        elif op[0] == "remove" and model.queued:
            req = model.queued.pop(op[1] % len(model.queued))[0]
            assert p.remove(req) is True
            out.append(req)
        elif op[0] == "remove" and out:
            assert p.remove(out[op[1] % len(out)]) is False
        elif op[0] == "charge":
            p.charge(op[1], op[2], op[3])
            model.charge(op[1], op[2], op[3])
        elif op[0] == "tick":
            clock.now += op[1]
            model.tick(op[1])
        elif op[0] == "set_counters":
            p.set_counters({op[1]: float(op[2])})
            model.counters[op[1]] = float(op[2])
        elif op[0] == "decoding" and model.rates[op[1]] + op[2] >= 0:
            p.add_decoding(op[1], op[2])
            model.rates[op[1]] += op[2]
        elif op[0] == "decode_step":  # charged lazily by the policy, one charge a step here
            missed = {t: min(m, model.rates[t]) for t, m in op[1].items()}
            p.charge_decode_step(missed)
            for tenant in TENANTS:
                tokens = model.rates[tenant] - missed.get(tenant, 0)
                if tokens:
                    model.charge(tenant, 0, tokens)
        # Counters compared only now and then: counters() settles every rate-charged step, and
        # the decisions in between must be right with the charges still pending.
        check_against_model(p, model, counters=len(out) % 4 == 0)
    check_against_model(p, model)


def check_against_model(p: Policy, model: Model, counters: bool = True) -> None:
    head = p.peek()
    assert head is model.select()
    assert len(p) == len(model.queued)
    assert {r.request_id for r in p} == {item[0].request_id for item in model.queued}
    if counters:
        assert p.counters() == model.counters
    for tenant in TENANTS:
        assert p.quota_eligible(tenant) == model.eligible(tenant)
    # rank() agrees with the order: the head has the smallest rank among eligible requests.
    ranks = [p.rank(item[0]) for item in model.queued if model.eligible(item[0].tenant)]
    if head is not None:
        assert p.rank(head) == min(ranks)


@pytest.mark.parametrize("name", POLICIES)
def test_charge_step_equals_one_charge_per_tenant(name: str) -> None:
    """The scheduler's batched charge gives the same counters, service, quota levels and
    throttling as one `charge` per tenant."""
    specs = [
        TenantSpec("a", weight=2.0),
        TenantSpec("b", weight=0.5, tokens_per_minute=60),
        TenantSpec("c", tokens_per_minute=600),
    ]
    clock_one, clock_batch = FakeClock(), FakeClock()
    one = make_policy(name, specs, clock=clock_one)
    batch = make_policy(name, specs, clock=clock_batch)
    steps = [
        ({"a": 16, "b": 40}, {"a": 3, "c": 5}),
        ({}, {"a": 1, "b": 30, "c": 1, "new": 2}),  # b goes into debt; "new" is registered
        ({"new": 7}, {}),
    ]
    for i, (prefill, decode) in enumerate(steps):
        clock_one.now = clock_batch.now = float(i)
        for tenant in sorted(prefill.keys() | decode.keys()):
            one.charge(tenant, prefill.get(tenant, 0), decode.get(tenant, 0))
        batch.charge_step(prefill, decode)
        assert batch.counters() == pytest.approx(one.counters())
        assert batch.service() == pytest.approx(one.service())
        for t in ("a", "b", "c", "new"):
            assert batch.quota_eligible(t) == one.quota_eligible(t)
            assert batch.retry_after(t) == pytest.approx(one.retry_after(t))
    assert not batch.quota_eligible("b")  # 70 tokens against a 60-token bucket
    assert batch.service()["a"] == pytest.approx(16 + 2 * 3 + 2 * 1)
    assert batch.counters()["b"] == pytest.approx((40 + 2 * 30) / 0.5)


@pytest.mark.parametrize("name", POLICIES)
@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("decoding"), st.sampled_from("abc"), st.sampled_from([1, 1, 2, -1])),
            st.tuples(st.just("step"), st.dictionaries(st.sampled_from("abc"), st.integers(0, 3))),
            st.tuples(st.just("step"), st.just({})),
            st.tuples(st.just("weight"), st.sampled_from("abc"), st.sampled_from([0.5, 1.0, 4.0])),
            st.tuples(st.just("tick"), st.integers(0, 3)),
            st.tuples(
                st.just("read"),
            ),
        ),
        max_size=40,
    )
)
def test_rate_charged_decode_equals_charge_step(name: str, ops: list[tuple]) -> None:
    """The scheduler's per-step path (`add_decoding` + `charge_decode_step`, settled lazily)
    leaves counters, service, raw tokens, quota levels and throttling exactly as one
    `charge_step` per step with the tokens spelled out, across weight changes and reads."""
    specs = [
        TenantSpec("a", weight=2.0),
        TenantSpec("b", weight=0.5, tokens_per_minute=1),  # soon in debt: retry_after shows it
        TenantSpec("c", tokens_per_minute=600),
    ]
    clock = FakeClock()
    rated = make_policy(name, specs, clock=clock)
    spelled = make_policy(name, specs, clock=clock)
    rates = dict.fromkeys("abc", 0)
    for op in ops:
        if op[0] == "decoding" and rates[op[1]] + op[2] >= 0:
            rated.add_decoding(op[1], op[2])
            rates[op[1]] += op[2]
        elif op[0] == "step":
            missed = {t: min(m, rates[t]) for t, m in op[1].items()}
            rated.charge_decode_step(missed)
            decode = {t: rates[t] - missed.get(t, 0) for t in rates}
            spelled.charge_step({}, {t: n for t, n in decode.items() if n})
        elif op[0] == "weight":  # applies to later charges only
            rated.update_tenant(op[1], weight=op[2])
            spelled.update_tenant(op[1], weight=op[2])
        elif op[0] == "tick":
            clock.now += op[1]
        else:
            assert rated.counters() == pytest.approx(spelled.counters())
        for t in "abc":  # quota state is kept eagerly: it must agree after every step
            assert rated.quota_eligible(t) == spelled.quota_eligible(t)
            assert rated.retry_after(t) == pytest.approx(spelled.retry_after(t))
    assert rated.decode_rates() == {t: n for t, n in rates.items() if n}
    assert rated.counters() == pytest.approx(spelled.counters())
    assert rated.service() == pytest.approx(spelled.service())
    assert rated.tokens() == spelled.tokens()


def test_counters_view_is_settled_read_only_and_live() -> None:
    p = make_policy("weighted_fair", [TenantSpec("a", weight=2.0), TenantSpec("b")])
    p.add_decoding("a", 3)
    p.charge_decode_step({})  # rate-charged: a's counter is pending until read
    view = p.counters_view()
    assert view["a"] == p.counters()["a"] == 3 * 2.0 / 2.0  # 3 tokens x output weight 2 / 2
    with pytest.raises(TypeError):
        view["a"] = 0.0  # type: ignore[index]
    p.charge("b", 4, 0)  # an eager charge shows in the live view at once
    assert view["b"] == 4.0
