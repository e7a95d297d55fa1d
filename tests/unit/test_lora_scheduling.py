"""LoRA adapter slots in the scheduler (issue 46): who overtakes a request that waits for a
slot, why it cannot starve (scheduler/loras.py), and tenants charged by tokens whatever
adapter they use. A fake pool with N slots stands in for engine/lora.py's LoRAPool."""

import random
from collections import Counter

from fairbatch.kv.manager import KVCacheManager
from fairbatch.policies import TenantSpec, make_policy
from fairbatch.scheduler import Request, Scheduler, SchedulerConfig
from fairbatch.scheduler.fake_runner import FakeRunner
from fairbatch.scheduler.loras import LoRASlots


class FakePool:
    """`num_slots` adapter slots: pinned while a request runs, LRU eviction of unpinned ones
    (the contract of LoRAPool's can_load / load / release)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.resident: list[str] = []  # least recently used first
        self.pins: Counter[str] = Counter()
        self.loads: list[str] = []

    def can_load(self, name: str) -> bool:
        return (
            name in self.resident
            or len(self.resident) < self.num_slots
            or any(self.pins[r] == 0 for r in self.resident)
        )

    def load(self, name: str, adapter: object) -> None:
        assert adapter == f"weights of {name}"
        if name not in self.resident:
            if len(self.resident) == self.num_slots:
                victim = next(r for r in self.resident if self.pins[r] == 0)  # StopIteration: full
                self.resident.remove(victim)
            self.resident.append(name)
            self.loads.append(name)
        self.pins[name] += 1
        self.resident.remove(name)
        self.resident.append(name)

    def release(self, name: str) -> None:
        assert self.pins[name] > 0, name
        self.pins[name] -= 1


def make_sched(num_slots, policy="fcfs", tenants=(), **cfg):
    kv = KVCacheManager(64, 4, 0, enable_prefix_caching=False)
    cfg.setdefault("max_model_len", 256)
    cfg.setdefault("max_num_batched_tokens", 64)
    sched = Scheduler(SchedulerConfig(**cfg), kv, make_policy(policy, tenants))
    pool = FakePool(num_slots)
    sched.loras = LoRASlots(pool)
    sched.loras.adapters = {name: f"weights of {name}" for name in "ABCDE"}
    return sched, pool


def req(rid, lora=None, max_tokens=1, tenant="default", prompt=(1, 2)):
    return Request(rid, list(prompt), max_tokens, tenant=tenant, lora_name=lora)


def run(sched, arrivals=None, steps=100):
    """Step until done; `arrivals[k]`: requests added just before step k (from 1). Returns the
    ids scheduled in each step, sorted."""
    arrivals = arrivals or {}
    runner = FakeRunner()
    got = []
    for k in range(1, steps + 1):
        for r in arrivals.get(k, ()):
            sched.add_request(r)
        if not sched.has_unfinished and k > max(arrivals, default=0):
            return got
        out = sched.schedule()
        got.append(sorted(r.request_id for r in out.scheduled))
        sched.update_from_output(out, runner.execute(out))
        sched.check_integrity()
        assert sched.loras.running == +sched.loras.pool.pins  # its count is the pool's pins
    raise AssertionError("requests did not finish")


def test_base_requests_overtake_and_the_draining_adapter_waits():
    """One slot. b (adapter B) finds A pinned by a1: it is the waiter, A drains. The base
    request c overtakes b; a2 (A, resident) does not, or A would never drain. When a1 ends,
    b gets the slot at once; then a2 waits for B in turn."""
    sched, pool = make_sched(1)
    first = [req("a1", "A", 3), req("b", "B"), req("c"), req("a2", "A")]
    got = run(sched, {1: first})
    assert got == [["a1", "c"], ["a1"], ["a1"], ["b"], ["a2"]]
    assert pool.loads == ["A", "B", "A"]


def test_waiter_is_not_starved_by_a_stream_of_its_slots_adapter():
    """One slot, a new request of adapter A every step: A never drains by itself. b gets the
    slot as soon as the A requests running when it arrived are done; the later ones wait."""
    sched, pool = make_sched(1)
    arrivals = {k: [req(f"a{k}", "A", 2)] for k in range(1, 7)}
    arrivals[2].append(req("b", "B", 2))
    got = run(sched, arrivals)
    # a1 runs (prefill, decode); a2 came before b and starts in step 2 (b is queued behind
    # it); b finds A pinned in step 2 and 3, waits for a2, starts in step 4 alone.
    assert got[:6] == [["a1"], ["a1", "a2"], ["a2"], ["b"], ["b"], ["a3", "a4", "a5", "a6"]]
    assert pool.loads == ["A", "B", "A"]


def test_other_resident_adapters_overtake_the_one_draining_does_not():
    """Two slots, A (1 running) and C (2 running). d (adapter D) waits; A, with fewer running
    requests, drains. c3 (C, pinned) and the base request e overtake d; a2 (A) and f (adapter
    E, would need a slot) wait. a1 ends: d takes A's slot, before f and a2."""
    sched, pool = make_sched(2)
    first = [req("a1", "A", 2), req("c1", "C", 6), req("c2", "C", 6)]
    second = [req("d", "D", 2), req("a2", "A"), req("f", "E"), req("c3", "C"), req("e")]
    got = run(sched, {1: first, 2: second})
    assert got[:3] == [["a1", "c1", "c2"], ["a1", "c1", "c2", "c3", "e"], ["c1", "c2", "d"]]
    # From step 3 f waits (C has 2 running, D 1: D drains) and a2 behind it: adapters share
    # the tenant's service (policies/flows.py), and A was charged a1's last token (flow
    # counters: every flow lifted to 8 on arrival, then A 10, E 8). d ends in step 4, f takes
    # D's slot in step 5; then a2 waits, E drains (f ends at once), a2 goes.
    assert got[3:] == [["c1", "c2", "d"], ["c1", "c2", "f"], ["a2", "c1", "c2"]]
    assert pool.loads == ["A", "C", "D", "E", "A"]


def test_a_waiter_that_leaves_gives_the_turn_up():
    """An aborted waiter releases the adapters it held back (here a2, of the draining A)."""
    sched, _ = make_sched(1)
    runner = FakeRunner()
    for r in (req("a1", "A", 5), req("b", "B"), req("a2", "A")):
        sched.add_request(r)
    out = sched.schedule()
    assert [r.request_id for r in out.scheduled] == ["a1"]
    assert sched.loras.waiter.request_id == "b" and sched.loras.draining == "A"
    sched.update_from_output(out, runner.execute(out))
    assert sched.abort("b")
    assert sched.loras.waiter is None and sched.loras.draining is None
    out = sched.schedule()
    assert sorted(r.request_id for r in out.scheduled) == ["a1", "a2"]


def test_weighted_fair_charges_tokens_whatever_the_adapter():
    """Tenant x runs three adapters and the base model, y the base model only; counters are
    input_weight * prompt + output_weight * output tokens (1 and 2 here) over the weight,
    step by step, exactly as if x used no adapter: an adapter's load costs the tenant
    nothing, and service is the tenant's, whichever adapter it went to."""

    def counters_per_step(loras):
        tenants = [TenantSpec("x", weight=2.0), TenantSpec("y")]
        sched, pool = make_sched(2, policy="weighted_fair", tenants=tenants)
        runner = FakeRunner()
        prompts = {"x1": [1, 2, 3], "x2": [4, 5], "x3": [6], "x4": [7, 8], "y1": [9, 9]}
        for (rid, prompt), lora in zip(prompts.items(), loras):
            tenant = rid[0]
            sched.add_request(Request(rid, prompt, 2, tenant=tenant, lora_name=lora))
        seen = []
        while sched.has_unfinished:
            out = sched.schedule()
            sched.update_from_output(out, runner.execute(out))
            counters = sched.policy.counters()
            seen.append((sorted(r.request_id for r in out.scheduled), counters))
        return seen, pool.loads

    with_loras, loads = counters_per_step(["A", "B", "C", None, None])
    without, no_loads = counters_per_step([None] * 5)
    # step 1: x1, x2 (A, B) take both slots; x3 (C) waits; x4 and y1 (base) overtake it
    assert with_loras == [
        (["x1", "x2", "x4", "y1"], {"x": (7 + 2 * 3) / 2, "y": 2 + 2}),
        (["x1", "x2", "x4", "y1"], {"x": (7 + 2 * 6) / 2, "y": 2 + 4}),
        (["x3"], {"x": (8 + 2 * 7) / 2, "y": 6}),
        (["x3"], {"x": (8 + 2 * 8) / 2, "y": 6}),
    ]
    assert loads == ["A", "B", "C"] and no_loads == []
    # the base-model run schedules x3 in step 1; the totals are the same tokens
    assert without[-1][1] == with_loras[-1][1] == {"x": 12.0, "y": 6.0}
    assert without[0] == (["x1", "x2", "x3", "x4", "y1"], {"x": (8 + 2 * 4) / 2, "y": 4})


def test_waiter_of_a_tenant_behind_in_policy_order_is_not_starved():
    """weighted_fair, one slot. y streams adapter-A requests; x has b (adapter B) and a stream
    of base requests, which overtake b and raise x's counter, so y's requests often rank
    before b. Still no A request starts after b began to wait: b runs once the A requests
    running then have ended."""
    sched, _ = make_sched(1, policy="weighted_fair", tenants=[TenantSpec("x"), TenantSpec("y")])
    arrivals = {
        k: [req(f"y{k}", "A", 3, tenant="y"), req(f"x{k}", None, 1, tenant="x")]
        for k in range(1, 9)
    }
    arrivals[2].insert(0, req("b", "B", 1, tenant="x"))
    got = run(sched, arrivals)
    # Step 2: b waits for A's slot (y1 pins it). In step 3 y's counter (6) is below x's
    # (8: x2 overtook b), so y2 ranks before b, but it is of the draining adapter: it waits.
    # y1 ends in step 3, b runs in step 4; then y's requests go.
    assert sched.policy.tokens() == {"x": (9 * 2, 9), "y": (8 * 2, 8 * 3)}  # (prompt, output)
    assert got[:5] == [
        ["x1", "y1"],
        ["x2", "y1"],
        ["x3", "y1"],
        ["b", "x4"],
        ["x5", "y2", "y3", "y4", "y5"],
    ]


def test_random_workloads_finish_with_every_slot_released():
    """Random tenants, priorities, adapters, lengths and arrivals with few KV blocks (swap,
    recompute and priority preemption) and two slots: everything finishes, and the pins are
    always the running requests' adapters."""

    for seed in range(20):
        rng = random.Random(seed)
        tenants = [TenantSpec("x"), TenantSpec("y", weight=2.0)]
        policy = rng.choice(["fcfs", "weighted_fair", "round_robin", "priority"])
        kv = KVCacheManager(12, 4, rng.choice([0, 16]), enable_prefix_caching=True)
        config = SchedulerConfig(max_model_len=40, max_num_batched_tokens=16, max_num_seqs=4)
        sched = Scheduler(config, kv, make_policy(policy, tenants))
        sched.loras = LoRASlots(FakePool(2))
        sched.loras.adapters = {name: f"weights of {name}" for name in "ABCDE"}
        arrivals: dict[int, list[Request]] = {}
        for i in range(30):
            lora = rng.choice([None, "A", "B", "C", "D"])
            prompt = [rng.randrange(50) for _ in range(rng.randint(1, 12))]
            tenant, priority = rng.choice("xy"), rng.choice([0, 1])
            r = Request(
                f"r{i}", prompt, rng.randint(1, 8), tenant=tenant, priority=priority, lora_name=lora
            )
            arrivals.setdefault(rng.randint(1, 20), []).append(r)
        got = run(sched, arrivals, steps=2000)
        assert {r for s in got for r in s} == {f"r{i}" for i in range(30)}
        assert not +sched.loras.pool.pins and sched.loras.waiter is None
