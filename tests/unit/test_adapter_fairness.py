"""Fairness between the LoRA adapters of one tenant: a VTC per flow, (tenant, adapter), inside
the tenant's share (policies/flows.py). Expected orders and counters are worked out by hand from
the weights (input 1, output 2 per token), through the real scheduler or the policy alone."""

from __future__ import annotations

import math
import random

import pytest

from fairbatch.kv.manager import KVCacheManager
from fairbatch.policies import TenantSpec, make_policy
from fairbatch.scheduler import Request, Scheduler, SchedulerConfig
from fairbatch.scheduler.fake_runner import FakeRunner
from fairbatch.scheduler.loras import LoRASlots

POLICIES_WITH_TENANT_QUEUES = ["fcfs", "weighted_fair", "round_robin", "priority"]


class PlainReq:
    """Stand-in for scheduler.request.Request with only what policies read, and no `lora_name`
    at all (as the cluster controller's tickets)."""

    __slots__ = ("request_id", "tenant", "seq", "priority", "arrival_time", "num_prompt_tokens")

    def __init__(self, rid, tenant, seq, priority=0) -> None:
        self.request_id = rid
        self.tenant = tenant
        self.seq = seq
        self.priority = priority
        self.arrival_time = 0.0
        self.num_prompt_tokens = 1

    def __repr__(self) -> str:
        return self.request_id


class Req(PlainReq):
    """With an adapter (`lora` None: the base model) and a deadline."""

    __slots__ = ("lora_name", "deadline")

    def __init__(self, rid, tenant, seq, lora=None, priority=0, deadline=math.inf) -> None:
        super().__init__(rid, tenant, seq, priority)
        self.lora_name = lora
        self.deadline = deadline


def drain(policy) -> list[str]:
    out = []
    while policy.peek() is not None:
        out.append(policy.pop().request_id)
    return out


# ---- through the scheduler ----------------------------------------------------------------


class RoomyPool:
    """Adapter slots for every adapter (LoRAPool's contract): no request waits for a slot, so
    only the policy decides the order."""

    def can_load(self, name: str) -> bool:
        return True

    def load(self, name: str, adapter: object) -> None:
        pass

    def release(self, name: str) -> None:
        pass


def make_sched(policy="weighted_fair", tenants=(), max_num_seqs=1, loras=True):
    kv = KVCacheManager(64, 4, 0, enable_prefix_caching=False)
    config = SchedulerConfig(
        max_model_len=256, max_num_batched_tokens=64, max_num_seqs=max_num_seqs
    )
    sched = Scheduler(config, kv, make_policy(policy, tenants))
    if loras:
        sched.loras = LoRASlots(RoomyPool())
        sched.loras.adapters = {name: None for name in "ABC"}
    return sched


def run(sched, after_step=None) -> list[str]:
    """Step until done; the ids in the order they started. `after_step()` runs after each."""
    runner = FakeRunner()
    started: list[str] = []
    for _ in range(10_000):
        if not sched.has_unfinished:
            return started
        out = sched.schedule()
        started += [r.request_id for r in out.scheduled if r.request_id not in started]
        sched.update_from_output(out, runner.execute(out))
        if after_step is not None:
            after_step()
    raise AssertionError("requests did not finish")


def test_exact_order_and_flow_counters_through_the_scheduler() -> None:
    """One seat, so each request runs to its end before the next starts. a1..a6 (adapter A:
    3 prompt tokens, 2 generated: 3 + 2*2 = 7 each) are queued before b1, b2 (adapter B: 2
    prompt tokens, 3 generated: 2 + 2*3 = 8 each). Both flows start at 0 (B is lifted to A's
    0 on arrival): a1 (tie, earlier seq), A=7; b1 (0 < 7), B=8; a2 (7 < 8), A=14; b2 (8 < 14),
    B=16; B has nothing queued any more: a3..a6, A=14 + 4*7 = 42."""
    sched = make_sched()
    for i in range(1, 7):
        sched.add_request(Request(f"a{i}", [1, 2, 3], 2, tenant="t", lora_name="A"))
    for i in range(1, 3):
        sched.add_request(Request(f"b{i}", [4, 5], 3, tenant="t", lora_name="B"))
    seen = []

    def after_step() -> None:
        seen.append(sched.policy.flow_counters())

    assert run(sched, after_step) == ["a1", "b1", "a2", "b2", "a3", "a4", "a5", "a6"]
    policy = sched.policy
    assert policy.flow_counters() == {("t", "A"): 42.0, ("t", "B"): 16.0}
    assert policy.flow_service() == {("t", "A"): 42.0, ("t", "B"): 16.0}
    # the tenant is charged the same tokens: 6*7 + 2*8, weight 1
    assert policy.counters() == {"t": 58.0} and policy.service() == {"t": 58.0}
    assert policy.tokens() == {"t": (6 * 3 + 2 * 2, 6 * 2 + 2 * 3)}
    # a1's two steps: prefill (3) + its first token (2), then its second token (2)
    assert seen[:2] == [{("t", "A"): 5.0, ("t", "B"): 0.0}, {("t", "A"): 7.0, ("t", "B"): 0.0}]


def test_without_adapter_slots_flows_are_not_charged() -> None:
    """An engine serving no LoRA charges no flows (it pays nothing per step for them): the
    same requests go in arrival order, as before flows existed."""
    sched = make_sched(loras=False)

    def no_flow_charges(prefill, decode) -> None:
        raise AssertionError("a base-only engine charged flows")

    sched.policy.charge_flows = no_flow_charges
    for i in range(1, 4):
        sched.add_request(Request(f"a{i}", [1, 2, 3], 2, tenant="t", lora_name="A"))
    sched.add_request(Request("b1", [4, 5], 3, tenant="t", lora_name="B"))
    assert run(sched) == ["a1", "a2", "a3", "b1"]
    assert sched.policy.counters() == {"t": 3 * 7 + 8.0}


def test_tenant_counters_are_those_without_adapters() -> None:
    """Two tenants, x (weight 2) with adapters and y with the base model. Every request of a
    tenant has the same length, so which of its requests runs does not change its charges:
    tenant counters are the same step by step whether x names adapters (its own order then
    changes) or not. A tenant's service is the sum of its flows' after every step."""

    def counters_per_step(loras):
        sched = make_sched(tenants=[TenantSpec("x", weight=2.0), TenantSpec("y")], max_num_seqs=2)
        for i, lora in enumerate(loras, 1):
            sched.add_request(Request(f"x{i}", [1, 2, 3], 2, tenant="x", lora_name=lora))
        for i in range(1, 4):
            sched.add_request(Request(f"y{i}", [7, 8], 3, tenant="y"))
        policy = sched.policy
        seen = []

        def after_step() -> None:
            seen.append(policy.counters())
            service = policy.service()
            for tenant in ("x", "y"):
                flows = [v for (t, _), v in policy.flow_service().items() if t == tenant]
                assert sum(flows) == service[tenant]

        return run(sched, after_step), seen

    order, with_adapters = counters_per_step(["A", "A", "A", "B", None])
    plain_order, without = counters_per_step([None] * 5)
    assert with_adapters == without
    # x: 5 * (3 + 2*2) / 2; y: 3 * (2 + 2*3)
    assert with_adapters[-1] == {"x": 17.5, "y": 24.0}
    assert [r for r in plain_order if r[0] == "x"] == ["x1", "x2", "x3", "x4", "x5"]
    assert [r for r in order if r[0] == "x"] != ["x1", "x2", "x3", "x4", "x5"]  # B, base earlier


@pytest.mark.parametrize("policy", ["weighted_fair", "fcfs", "round_robin"])
def test_two_backlogged_flows_stay_within_one_request_through_the_scheduler(policy) -> None:
    """One seat: a request runs to its end before the next starts, and it is charged at most
    M = P + 2*D (P <= 12 prompt tokens, D <= 8 generated). Both flows always have requests
    queued (never emptied, so never lifted). At each start the flow started has the smaller
    counter, and until the next start only it is charged, by at most M: so |A - B| <= M at
    every step, whatever the lengths."""
    rng = random.Random(7)
    sched = make_sched(policy)
    policy_ = sched.policy
    count = {"A": 0, "B": 0}
    bound = 12 + 2 * 8

    def top_up() -> None:
        queued = {"A": 0, "B": 0}
        for r in policy_:
            queued[r.lora_name] += 1
        for flow in "AB":
            while queued[flow] < 2:
                count[flow] += 1
                prompt = [rng.randrange(1, 50) for _ in range(rng.randint(1, 12))]
                rid = f"{flow.lower()}{count[flow]}"
                r = Request(rid, prompt, rng.randint(1, 8), tenant="t", lora_name=flow)
                sched.add_request(r)
                queued[flow] += 1

    top_up()
    runner = FakeRunner()
    worst = 0.0
    for _ in range(400):
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
        counters = policy_.flow_counters()
        gap = abs(counters[("t", "A")] - counters[("t", "B")])
        assert gap <= bound
        worst = max(worst, gap)
        assert sum(policy_.flow_service().values()) == policy_.service()["t"]
        top_up()
    assert worst > 0 and count["A"] > 10 and count["B"] > 10


# ---- through the policy alone ---------------------------------------------------------------


def test_lift_banks_no_credit() -> None:
    """Explicit flow charges (they do not touch the tenant counters)."""
    p = make_policy("weighted_fair")
    a1, a2, a3 = (Req(f"a{i}", "t", i, "A") for i in (1, 2, 3))
    for r in (a1, a2, a3):
        p.enqueue(r)
    assert p.pop() is a1
    p.charge_flows({("t", "A"): 10}, {})  # A = 10
    assert p.pop() is a2
    p.charge_flows({}, {("t", "A"): 5})  # A = 10 + 2*5 = 20
    # B arrives while A is backlogged (a3): max(0, min of the others' = 20), not 0
    b1 = Req("b1", "t", 4, "B")
    p.enqueue(b1)
    assert p.flow_counters() == {("t", "A"): 20.0, ("t", "B"): 20.0}
    assert p.pop() is a3  # a tie: the earlier head
    p.charge_flows({("t", "A"): 1}, {})  # A = 21
    assert p.pop() is b1
    p.charge_flows({("t", "B"): 30}, {})  # B = 50; nothing of t queued now
    # A comes back to an empty queue: max(21, counter of the flow served last, B's 50)
    a4 = Req("a4", "t", 5, "A")
    p.enqueue(a4)
    assert p.flow_counters()[("t", "A")] == 50.0
    assert p.pop() is a4
    p.charge_flows({("t", "A"): 100}, {})  # A = 150
    # B comes back, A served last: max(50, 150)
    p.enqueue(Req("b2", "t", 6, "B"))
    assert p.flow_counters()[("t", "B")] == 150.0
    assert p.pop().request_id == "b2"
    p.charge_flows({("t", "B"): 1000}, {})  # B = 1150
    # A comes back, B served last: max(150, 1150)
    p.enqueue(Req("a5", "t", 7, "A"))
    assert p.flow_counters()[("t", "A")] == 1150.0
    assert p.pop().request_id == "a5"  # A served last, at 1150
    p.charge_flows({("t", "B"): 500}, {})  # (B's requests still running) B = 1650
    # B comes back above the floor (A's 1150): it keeps its own counter
    p.enqueue(Req("b3", "t", 8, "B"))
    assert p.flow_counters()[("t", "B")] == 1650.0
    # a requeued request never lifts its flow, and goes first all the same
    p.requeue(Req("c1", "t", 9, "C"))
    assert p.flow_counters()[("t", "C")] == 0.0
    assert p.pop().request_id == "c1"
    assert p.counters() == {"t": 0.0}  # flow charges are not tenant charges


def test_requeued_requests_still_go_first() -> None:
    p = make_policy("weighted_fair")
    a1, a2, a3 = (Req(f"a{i}", "t", i, "A") for i in (1, 2, 3))
    b1, b2 = Req("b1", "t", 4, "B"), Req("b2", "t", 5, "B")
    for r in (a1, a2, a3, b1, b2):
        p.enqueue(r)
    assert p.pop() is a1
    p.charge_flows({("t", "A"): 100}, {})
    assert p.pop() is b1  # B 0 < A 100
    p.requeue(b1)
    p.requeue(a1)  # A is far ahead, but preempted work goes first, by seq
    assert drain(p) == ["a1", "b1", "b2", "a2", "a3"]


@pytest.mark.parametrize("policy", ["fcfs", "weighted_fair"])
def test_edf_orders_by_deadline_within_a_flow(policy) -> None:
    """Under edf each flow goes by deadline; between flows, by counter, ties by the earlier
    head. A: a1 (30), a2 (10), a3 (20); B: b1 (50), b2 (5). 0/0: b2 (5 < 10), B=10; A 0: a2,
    A=10; 10/10: a3 (20 < 50), A=20; B 10: b1, B=20; a1."""
    p = make_policy(policy, order_within_tenant="edf")
    deadlines = {"a1": 30, "a2": 10, "a3": 20, "b1": 50, "b2": 5}
    reqs = {
        rid: Req(rid, "t", seq, rid[0].upper(), deadline=d)
        for seq, (rid, d) in enumerate(deadlines.items(), 1)
    }
    for r in reqs.values():
        p.enqueue(r)
    got = []
    while p.peek() is not None:
        r = p.pop()
        got.append(r.request_id)
        p.charge_flows({("t", r.lora_name): 10}, {})
    assert got == ["b2", "a2", "a3", "b1", "a1"]
    # the same deadlines without adapters: one flow, by deadline
    q = make_policy(policy, order_within_tenant="edf")
    for seq, (rid, d) in enumerate(deadlines.items(), 1):
        q.enqueue(Req(rid, "t", seq, deadline=d))
    assert drain(q) == ["b2", "a2", "a3", "a1", "b1"]


@pytest.mark.parametrize("policy", POLICIES_WITH_TENANT_QUEUES)
def test_a_smaller_key_of_a_flow_ahead_does_not_become_the_head(policy) -> None:
    """The head of a tenant's queue is kept as entries arrive: a request of a flow whose
    counter is higher does not take the head by having a smaller key (an earlier deadline)."""
    p = make_policy(policy, order_within_tenant="edf")
    p.enqueue(Req("a1", "t", 1, "A", deadline=40))
    p.enqueue(Req("b1", "t", 2, "B", deadline=50))
    assert p.pop().request_id == "a1"
    p.charge_flows({("t", "A"): 100}, {})
    p.enqueue(Req("a2", "t", 3, "A", deadline=1))
    assert p.peek().request_id == "b1"
    assert p.rank(p.peek()) == min(p.rank(r) for r in p)
    # and a charge that makes another flow the smaller re-heads the tenant
    p.charge_flows({("t", "B"): 200}, {})
    assert p.peek().request_id == "a2"
    assert p.rank(p.peek()) == min(p.rank(r) for r in p)


def test_flows_do_not_change_the_choice_between_tenants() -> None:
    """fcfs between tenants by their heads' seq: x's head is its B request (B is behind in
    service), y's is y1; x's B request is older than y1, so x goes, then y."""
    p = make_policy("fcfs")
    for r in (Req("xa1", "x", 1, "A"), Req("xa2", "x", 2, "A"), Req("xb1", "x", 3, "B")):
        p.enqueue(r)
    p.enqueue(Req("y1", "y", 4))
    assert p.pop().request_id == "xa1"
    p.charge_flows({("x", "A"): 10}, {})
    assert drain(p) == ["xb1", "xa2", "y1"]


def test_two_backlogged_flows_stay_within_one_charge() -> None:
    """Each round pops the head and charges its flow at most M = P + 2*D (P = 12, D = 8), as
    one request's step; both flows always have requests queued. The flow popped has the
    smaller counter, so after the charge it is at most M above the other: |A - B| <= M."""
    bound = 12 + 2 * 8
    for name in POLICIES_WITH_TENANT_QUEUES:
        rng = random.Random(11)
        p = make_policy(name)
        for seq, flow in enumerate("ABAB", 1):
            p.enqueue(Req(f"{flow}{seq}", "t", seq, flow))
        for seq in range(5, 2005):
            r = p.pop()
            prefill, decode = rng.randint(0, 12), rng.randint(0, 8)
            p.charge_flows({("t", r.lora_name): prefill}, {("t", r.lora_name): decode})
            p.charge("t", prefill, decode)
            p.enqueue(Req(f"{r.lora_name}{seq}", "t", seq, r.lora_name))  # never empty: no lift
            counters = p.flow_counters()
            assert abs(counters[("t", "A")] - counters[("t", "B")]) <= bound
        assert p.service()["t"] == sum(p.flow_service().values())


# ---- a single flow, and the rank contract, under random operations ------------------------


def random_ops(rng: random.Random, n: int, loras_of) -> list[tuple]:
    """Operations over tenants a, b, c: enqueue, pop, requeue a popped one, remove, tenant
    and flow charges. `loras_of(tenant, rng)` picks a new request's adapter."""
    ops: list[tuple] = []
    for i in range(n):
        kind = rng.choice(["enqueue"] * 4 + ["pop"] * 3 + ["requeue", "remove", "charge"])
        tenant = rng.choice("abc")
        if kind == "enqueue":
            ops.append(("enqueue", f"r{i}", tenant, i, loras_of(tenant, rng), rng.choice([0, 1])))
        elif kind == "charge":
            ops.append(("charge", tenant, rng.randint(0, 9), rng.randint(0, 5)))
        else:
            ops.append((kind, rng.random()))
    return ops


def play(policy, ops, with_lora: bool, check=None) -> list[str]:
    """Apply `ops`; returns the popped ids. Flow charges go to the flow of the tenant's request
    popped last (as a step would), and only when `with_lora` (a LoRA engine)."""
    reqs: dict[str, Req] = {}
    popped: list[Req] = []
    last_flow: dict[str, object] = {}
    got: list[str] = []
    for op in ops:
        kind = op[0]
        if kind == "enqueue":
            _, rid, tenant, seq, lora, priority = op
            if with_lora:
                r = Req(rid, tenant, seq, lora, priority)
            else:
                r = PlainReq(rid, tenant, seq, priority)
            reqs[rid] = r
            policy.enqueue(r)
        elif kind == "pop" and policy.peek() is not None:
            r = policy.pop()
            got.append(r.request_id)
            popped.append(r)
            last_flow[r.tenant] = getattr(r, "lora_name", None)
        elif kind == "requeue" and popped:
            policy.requeue(popped.pop(int(op[1] * len(popped))))
        elif kind == "remove" and len(policy):
            queued = list(policy)
            policy.remove(queued[int(op[1] * len(queued))])
        elif kind == "charge":
            _, tenant, prefill, decode = op
            policy.charge(tenant, prefill, decode)
            if with_lora and tenant in last_flow:
                flow = (tenant, last_flow[tenant])
                policy.charge_flows({flow: prefill}, {flow: decode})
        if check is not None:
            check(policy, reqs)
    return got


@pytest.mark.parametrize("name", [*POLICIES_WITH_TENANT_QUEUES, "lpm", "dlpm"])
def test_a_single_flow_per_tenant_pops_exactly_as_before(name) -> None:
    """Each tenant uses one adapter (or the base model) throughout: the pops are those of the
    same operations without any adapter named, flow charges or not."""
    single = {"a": "A", "b": None, "c": "C"}
    for seed in range(15):
        ops = random_ops(random.Random(seed), 300, lambda tenant, rng: single[tenant])
        kw = {"tenants": [TenantSpec("a", weight=2.0)]}
        assert play(make_policy(name, **kw), ops, True) == play(make_policy(name, **kw), ops, False)


@pytest.mark.parametrize("name", POLICIES_WITH_TENANT_QUEUES)
def test_the_head_is_the_lowest_flows_and_rank_agrees(name) -> None:
    """Random operations with several flows per tenant. After each: peek's request is, inside
    its tenant (and class), the requeued one with the smallest seq, else the head by seq of
    the flow with the smallest counter; and it has the smallest rank of all queued requests."""

    def check(policy, reqs) -> None:
        head = policy.peek()
        if head is None:
            assert len(policy) == 0
            return
        queued = list(policy)
        assert policy.rank(head) == min(policy.rank(r) for r in queued)
        mine = [r for r in queued if r.tenant == head.tenant]
        if name == "priority":  # inside the head's class
            mine = [r for r in mine if r.priority == head.priority]
        requeued = [r for r in mine if policy._entries[r.request_id].key[0] == 0]
        if requeued:
            assert head is min(requeued, key=lambda r: r.seq)
        else:
            counters = policy.flow_counters()
            assert head is min(mine, key=lambda r: (counters[(r.tenant, r.lora_name)], r.seq))

    for seed in range(15):
        ops = random_ops(random.Random(seed), 300, lambda tenant, rng: rng.choice([None, "A", "B"]))
        play(make_policy(name), ops, True, check)
