"""dlpm and lpm: exact orders by hand, rank against peek, the KV lookup and the scheduler
wiring, and the fairness bound of policies/dlpm.py on long random runs (which lpm breaks)."""

from __future__ import annotations

import math
import random

import pytest

from fairbatch.kv.manager import KVCacheManager
from fairbatch.policies import POLICIES, DlpmPolicy, LpmPolicy, TenantSpec, make_policy
from fairbatch.policies.dlpm import DEFAULT_QUANTUM
from fairbatch.scheduler import Request, Scheduler, SchedulerConfig
from fairbatch.scheduler.fake_runner import FakeRunner

VOCAB = 1000


class Req:
    """Stand-in for scheduler.request.Request with only what policies read."""

    __slots__ = ("request_id", "tenant", "priority", "arrival_time", "seq")

    def __init__(self, request_id: str, tenant: str, seq: int, priority: int = 0) -> None:
        self.request_id = request_id
        self.tenant = tenant
        self.seq = seq
        self.priority = priority
        self.arrival_time = 0.0

    def __repr__(self) -> str:
        return self.request_id


def with_hits(policy, hits: dict[str, int]):
    """`policy` whose hit length is `hits[request_id]` (0 if absent), read at every peek."""
    policy.set_hit_length(lambda r: hits.get(r.request_id, 0))
    return policy


def mk(*names: str, priority: int = 0) -> list[Req]:
    """Requests named like 'a1': tenant = first letter, seq = position."""
    return [Req(name, name[0], i + 1, priority) for i, name in enumerate(names)]


def pop_id(p) -> str:
    return p.pop().request_id


# ---- exact orders ----------------------------------------------------------------------------


def test_lpm_longest_hit_first_requeued_first_ties_by_seq() -> None:
    hits = {"a1": 16, "b1": 64, "a2": 64, "b2": 0}
    p = with_hits(make_policy("lpm"), hits)
    reqs = mk("a1", "b1", "a2", "b2", "c1")
    for r in reqs[:4]:
        p.enqueue(r)
    p.requeue(reqs[4])  # preempted work goes first, whatever its hit
    assert [pop_id(p) for _ in range(5)] == ["c1", "b1", "a2", "a1", "b2"]
    # hit lengths are read at every peek, not when queued
    for r in reqs[:2]:
        p.enqueue(r)
    assert p.peek() is reqs[1]
    hits["a1"] = 128
    p.charge("a", 1, 0)  # (any step refreshes the answer; the cache moves with steps)
    assert p.peek() is reqs[0]


def test_dlpm_lpm_order_only_within_credit_and_weighted_refill() -> None:
    # Q = 10; a has weight 1, b weight 2: each refill adds 10 to a's deficit and 20 to b's.
    p = make_policy("dlpm", [TenantSpec("a"), TenantSpec("b", weight=2.0)], quantum=10)
    p = with_hits(p, {"a1": 48, "a2": 48, "a3": 48})  # a's always hit, b's never
    for r in mk("a1", "a2", "a3", "b1", "b2", "b3", "b4", "b5"):
        p.enqueue(r)
    assert pop_id(p) == "a1"  # both have a quantum of credit: the longest hit goes
    assert p.deficits() == {"a": 10.0, "b": 20.0}
    p.charge("a", 10, 0)  # a's deficit is spent (10 weighted tokens)
    assert p.deficits() == {"a": 0.0, "b": 20.0}
    assert pop_id(p) == "b1"  # a2 hits, but a has no credit left
    p.charge("b", 10, 0)
    assert pop_id(p) == "b2"  # b still has 10 of its 20
    p.charge("b", 4, 3)  # 4 + 2 x 3 = 10: spent
    # nobody has credit: one refill, and the longest hit among all goes again
    assert p.deficits() == {"a": 10.0, "b": 20.0}
    assert pop_id(p) == "a2"
    p.charge("a", 25, 0)  # a is 15 in debt
    assert pop_id(p) == "b3"
    p.charge("b", 10, 0)
    assert pop_id(p) == "b4"  # b has credit left; a, with the longer hits, has none
    p.charge("b", 40, 0)
    assert p.counters() == {"a": 35.0, "b": 35.0}
    assert p.deficits() == {"a": 5.0, "b": 10.0}  # two refills at once: level 20 -> 40
    assert [pop_id(p) for _ in range(2)] == ["a3", "b5"]
    assert p.peek() is None


def test_dlpm_lift_for_a_newly_backlogged_tenant_and_none_on_requeue() -> None:
    p = with_hits(make_policy("dlpm", quantum=10), {})
    a1, a2, b1, b2, c1, d1 = mk("a1", "a2", "b1", "b2", "c1", "d1")
    for r in (a1, a2, b1, b2):
        p.enqueue(r)
    assert p.peek() is a1  # level 10
    p.charge("a", 25, 0)
    p.charge("b", 18, 0)
    assert p.peek() is b1  # refilled once to level 20: only b (18) has credit
    p.enqueue(c1)  # c becomes backlogged: lifted from 0 to the lowest backlogged counter
    assert p.counters()["c"] == 18.0
    p.requeue(d1)  # a preempted request: its tenant did not idle, no lift
    assert p.counters()["d"] == 0.0
    assert pop_id(p) == "d1"  # requeued first among the tenants with credit
    # Nobody backlogged: the tenant served last sets the floor, as in weighted_fair.
    for r in list(p):
        p.remove(r)
    p.enqueue(b2)  # b's 18 is above the floor (d's 0, the level 20 less a quantum)
    assert p.counters()["b"] == 18.0
    assert pop_id(p) == "b2"
    p.charge("b", 7, 0)  # b: 25, the tenant served last
    p.enqueue(Req("e1", "e", 9))
    assert p.counters()["e"] == 25.0


def test_dlpm_counters_set_from_outside_reanchor_the_level() -> None:
    p = with_hits(make_policy("dlpm", quantum=10), {"a1": 32})
    a1, b1 = mk("a1", "b1")
    p.enqueue(a1)
    p.enqueue(b1)
    assert p.peek() is a1
    p.set_counters({"a": 1000.0, "b": 995.0})  # e.g. the cluster's shared counters
    assert p.deficits() == {"a": 5.0, "b": 10.0}  # one quantum above the lowest counter
    assert p.peek() is a1


def test_priority_classes_are_strict_with_dlpm_inside() -> None:
    p = with_hits(make_policy("dlpm", quantum=10), {"a1": 64, "a2": 64})
    a1, a2 = mk("a1", "a2")
    (b1,) = mk("b1", priority=1)
    for r in (a1, a2, b1):
        p.enqueue(r)
    p.charge("b", 1000, 0)  # b is far ahead, but its class goes first
    assert [pop_id(p) for _ in range(3)] == ["b1", "a1", "a2"]
    lpm = with_hits(make_policy("lpm"), {"a1": 64})
    for r in (a1, b1):
        lpm.enqueue(r)
    assert pop_id(lpm) == "b1"


@pytest.mark.parametrize("name", ["dlpm", "lpm"])
@pytest.mark.parametrize("seed", range(4))
def test_rank_agrees_with_peek(name: str, seed: int) -> None:
    """rank(peek()) is the smallest rank among queued requests after any operation."""
    rng = random.Random(seed)
    kw = {"quantum": rng.choice([8.0, 50.0, 400.0])} if name == "dlpm" else {}
    specs = [TenantSpec("a", weight=2.0), TenantSpec("b"), TenantSpec("c", weight=0.5)]
    hits: dict[str, int] = {}
    p = with_hits(make_policy(name, specs, **kw), hits)
    out: list[Req] = []
    for i in range(400):
        op = rng.random()
        if op < 0.35 or not len(p):
            r = Req(f"r{i}", rng.choice("abc"), i, priority=rng.choice([0, 0, 0, 1]))
            hits[r.request_id] = rng.choice([0, 16, 32, 64])
            p.enqueue(r)
        elif op < 0.45 and out:
            p.requeue(out.pop(rng.randrange(len(out))))
        elif op < 0.7:
            if p.peek() is not None:
                out.append(p.pop())
        elif op < 0.9:
            p.charge(rng.choice("abc"), rng.randrange(0, 60), rng.randrange(0, 20))
        elif op < 0.95:
            hits[rng.choice(list(hits))] = rng.choice([0, 16, 48])
            p.charge("a", 0, 0)
        else:
            p.set_counters({rng.choice("abc"): float(rng.randrange(0, 300))})
        head = p.peek()
        if len(p):
            assert head is not None
            assert p.rank(head) == min(p.rank(r) for r in p)
            for r in out[:3]:  # requests that are not queued are ranked too
                p.rank(r)


def test_quantum_is_validated_and_kwargs_checked() -> None:
    for bad in (0, -1.0, math.nan, math.inf, "64", None, True):
        with pytest.raises(ValueError, match="quantum must be a finite number > 0"):
            make_policy("dlpm", quantum=bad)
    with pytest.raises(TypeError, match="quantum"):
        make_policy("lpm", quantum=64)
    with pytest.raises(TypeError, match="inner"):
        make_policy("dlpm", inner="fcfs")
    with pytest.raises(ValueError, match="aging_s"):
        make_policy("dlpm", aging_s=0)
    with pytest.raises(TypeError, match="callable"):
        make_policy("lpm").set_hit_length(3)  # type: ignore[arg-type]


def test_registry() -> None:
    assert POLICIES["dlpm"] is DlpmPolicy and POLICIES["lpm"] is LpmPolicy
    p = make_policy("dlpm", [TenantSpec("a", weight=3.0)], quantum=64, aging_s=5.0)
    assert isinstance(p, DlpmPolicy) and p.quantum == 64.0 and p.aging_s == 5.0
    assert p.tenant("a").weight == 3.0 and p.wants_hit_length
    assert make_policy("dlpm").quantum == DEFAULT_QUANTUM
    assert isinstance(make_policy("lpm"), LpmPolicy) and make_policy("lpm").wants_hit_length
    assert not any(POLICIES[n].wants_hit_length for n in POLICIES if n not in ("dlpm", "lpm"))


def test_without_a_hit_length_lpm_is_fcfs_and_dlpm_deficit_round_robin() -> None:
    reqs = mk("a1", "a2", "a3", "b1", "b2")
    lpm = make_policy("lpm")
    dlpm = make_policy("dlpm", quantum=10)
    for r in reqs:
        lpm.enqueue(r)
        dlpm.enqueue(r)
    assert [pop_id(lpm) for _ in range(5)] == ["a1", "a2", "a3", "b1", "b2"]
    got = []
    while dlpm.peek() is not None:
        r = dlpm.pop()
        got.append(r.request_id)
        dlpm.charge(r.tenant, 10, 0)  # one quantum a request
    assert got == ["a1", "b1", "a2", "b2", "a3"]


# ---- the KV lookup and the scheduler wiring ----------------------------------------------------


def make_sched(policy: str, tenants=(), num_blocks=64, block_size=4, **kw) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, 0)
    cfg = SchedulerConfig(max_model_len=1024, **kw)
    return Scheduler(cfg, kv, make_policy(policy, tenants))


def kv_state(kv: KVCacheManager):
    pool = kv.gpu_pool
    return (
        {rid: list(h) for rid, h in kv.req_hashes.items()},
        {rid: list(p) for rid, p in kv.req_packed.items()},
        [b.block_id for b in pool.free_queue],
        [b.ref_cnt for b in pool.blocks],
        dict(pool.cached),
    )


def test_num_cached_prefix_tokens_matches_get_computed_blocks_and_changes_nothing() -> None:
    sched = make_sched("fcfs")
    runner = FakeRunner(VOCAB)
    doc = list(range(1, 30))  # 7 full blocks of 4, and a token
    sched.add_request(Request("warm", doc, max_tokens=2))
    while sched.has_unfinished:
        sched.update_from_output(out := sched.schedule(), runner.execute(out))
    kv = sched.kv
    cases = {
        "same": doc,  # 7 blocks cached, but one token must be left to compute: 28
        "longer": doc + [7, 8, 9, 10, 11],
        "fork": doc[:10] + [999] * 12,  # 2 blocks, then a miss
        "cold": [500] * 20,
        "grown": doc[:10],  # 2 blocks hashed at intake ...
    }
    for rid, tokens in cases.items():
        sched.add_request(Request(rid, tokens, max_tokens=1))
    sched.requests["grown"].all_token_ids.extend(doc[10:])  # ... then more tokens (output)
    unhashed = Request("unhashed", doc + [1, 2, 3], max_tokens=1)  # never added: no hashes
    before = kv_state(kv)
    got = {r.request_id: kv.num_cached_prefix_tokens(r) for r in [*sched.requests.values()]}
    got["unhashed"] = kv.num_cached_prefix_tokens(unhashed)
    assert kv_state(kv) == before
    assert got == {"same": 28, "longer": 28, "fork": 8, "cold": 0, "grown": 28, "unhashed": 28}
    for rid in cases:
        assert kv.get_computed_blocks(sched.requests[rid])[1] == got[rid]
    assert kv.get_computed_blocks(unhashed)[1] == 28
    running = sched.requests["same"]
    sched.schedule()  # admitted: holds blocks, so the lookup says 0, as get_computed_blocks
    assert kv.num_cached_prefix_tokens(running) == 0 == kv.get_computed_blocks(running)[1]
    assert KVCacheManager(8, 4, enable_prefix_caching=False).num_cached_prefix_tokens(running) == 0


def test_scheduler_feeds_the_hit_length_only_to_policies_that_want_it() -> None:
    for name in POLICIES:
        sched = make_sched(name)
        fed = sched.policy.hit_length == sched._hit_length
        assert fed == (name in ("dlpm", "lpm")) == POLICIES[name].wants_hit_length


@pytest.mark.parametrize("name", ["lpm", "dlpm"])
def test_the_cached_request_is_admitted_first(name: str) -> None:
    sched = make_sched(name, max_num_seqs=1)
    runner = FakeRunner(VOCAB)
    doc = list(range(1, 42))
    sched.add_request(Request("warm", doc, max_tokens=1, tenant="a"))
    sched.update_from_output(out := sched.schedule(), runner.execute(out))
    assert not sched.has_unfinished
    sched.add_request(Request("cold", [900] * 40, max_tokens=1, tenant="b"))
    sched.add_request(Request("hot", doc + [5], max_tokens=1, tenant="a"))  # (same salt)
    out = sched.schedule()
    assert [r.request_id for r in out.scheduled] == ["hot"]
    assert out.num_scheduled_tokens == {"hot": 2}  # 40 of its 42 tokens came from the cache


# ---- the fairness bound -------------------------------------------------------------------------

W_IN, W_OUT = 1.0, 2.0  # the policies' default input and output weights
SEATS = 8


def backlogged_run(policy, seed, steps, quantum, weights, prompts, blocks=96):
    """Tenants kept backlogged (>= 12 queued, more than a step can admit) on a real scheduler
    and prefix cache of `blocks` blocks of 16. `prompts(rng, tenant)` makes one prompt.
    Returns the counters after every step, the largest prompt and output lengths seen, and
    the scheduler."""
    rng = random.Random(seed)
    names = sorted(weights)
    specs = [TenantSpec(n, weight=weights[n]) for n in names]
    kw = {"quantum": quantum} if policy == "dlpm" else {}
    kv = KVCacheManager(blocks, 16, 0)  # no swap space: preemption recomputes
    cfg = SchedulerConfig(max_num_seqs=SEATS, max_num_batched_tokens=256, max_model_len=1024)
    sched = Scheduler(cfg, kv, make_policy(policy, specs, **kw))
    runner = FakeRunner(VOCAB)
    history, longest, most, n = [], 0, 0, 0
    for _ in range(steps):
        queued = dict.fromkeys(names, 0)
        for r in sched.policy:
            queued[r.tenant] += 1
        for tenant in names:
            for _ in range(12 - queued[tenant]):
                n += 1
                prompt = prompts(rng, tenant)
                max_tokens = rng.randrange(1, 65)
                longest, most = max(longest, len(prompt)), max(most, max_tokens)
                rid = f"{tenant}{n}"
                sched.add_request(Request(rid, prompt, max_tokens=max_tokens, tenant=tenant))
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
        assert {r.tenant for r in sched.policy} == set(names)  # still all backlogged
        history.append(sched.policy.counters())
        if policy == "dlpm":  # the bound's first step, checked directly: c_t >= L - Q
            level = sched.policy._classes[0].inner._level
            assert min(history[-1].values()) >= level - quantum
    return history, longest, most, sched


def dlpm_bound(quantum: float, longest: int, most: int, w_f: float, w_g: float) -> float:
    """B of policies/dlpm.py: Q + S * (w_in * P + w_out * D) / min(w_f, w_g)."""
    return quantum + SEATS * (W_IN * longest + W_OUT * most) / min(w_f, w_g)


def worst_excess(history, weights, quantum, longest, most) -> float:
    """The largest |c_f - c_g| - B over all steps and pairs (<= 0: within the bound)."""
    worst = -math.inf
    names = sorted(weights)
    for counters in history:
        for i, f in enumerate(names):
            for g in names[i + 1 :]:
                bound = dlpm_bound(quantum, longest, most, weights[f], weights[g])
                worst = max(worst, abs(counters[f] - counters[g]) - bound)
    return worst


def documents(seed: int, weights) -> dict[str, list[list[int]]]:
    """A few shared prefixes (16 to 200 tokens) per tenant."""
    rng = random.Random(1000 + seed)
    return {
        t: [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(16, 200))] for _ in range(4)]
        for t in weights
    }


def shared_prefix_prompts(docs):
    """A prompt: one of the tenant's documents and a random question of 1 to 32 tokens."""

    def make(rng: random.Random, tenant: str) -> list[int]:
        question = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 33))]
        return rng.choice(docs[tenant]) + question

    return make


WEIGHTS = {"a": 2.0, "b": 1.0, "c": 1.0}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("quantum", [64.0, 512.0, 4096.0])
@pytest.mark.parametrize("blocks", [96, 40])  # 40: preemptions (recompute) every few steps
def test_dlpm_stays_within_its_bound_at_every_step(seed: int, quantum: float, blocks: int) -> None:
    prompts = shared_prefix_prompts(documents(seed, WEIGHTS))
    history, longest, most, sched = backlogged_run(
        "dlpm", seed, 2500, quantum, WEIGHTS, prompts, blocks
    )
    assert worst_excess(history, WEIGHTS, quantum, longest, most) <= 0
    assert (sched.num_preemptions["recompute"] > 50) == (blocks == 40)
    # the quantum is what the tenants drift apart by: the bound's Q term is not idle
    diffs = [max(c.values()) - min(c.values()) for c in history]
    assert max(diffs) > 0.9 * quantum
    service = sched.policy.service()  # and the weights hold: a gets twice b's and c's share
    assert service["a"] / (service["b"] + service["c"]) == pytest.approx(1.0, rel=0.1)


def hit_rate(sched: Scheduler) -> float:
    prefill = sum(p for p, _ in sched.policy.tokens().values())
    return sched.num_prefix_hit_tokens / prefill


@pytest.mark.parametrize("seed", range(2))
def test_dlpm_keeps_more_prefix_hits_than_weighted_fair(seed: int) -> None:
    prompts = shared_prefix_prompts(documents(seed, WEIGHTS))
    rates = {}
    for policy in ("dlpm", "weighted_fair"):
        *_, sched = backlogged_run(policy, seed, 1500, 512.0, WEIGHTS, prompts)
        rates[policy] = hit_rate(sched)
    assert rates["dlpm"] > rates["weighted_fair"] + 0.15, rates


def test_lpm_breaks_the_bound_where_dlpm_keeps_it() -> None:
    # a's requests all share one long document: after the first, every one hits. b's prompts
    # are random: never a hit. LPM always prefers a's; b starves.
    weights = {"a": 1.0, "b": 1.0}
    doc = list(range(1, 161))

    def prompts(rng: random.Random, tenant: str) -> list[int]:
        question = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 33))]
        if tenant == "a":
            return doc + question
        return [rng.randrange(1, VOCAB) for _ in range(rng.randrange(16, 160))] + question

    quantum = 512.0
    history, longest, most, sched = backlogged_run("lpm", 0, 3000, quantum, weights, prompts)
    bound = dlpm_bound(quantum, longest, most, 1.0, 1.0)
    diffs = [c["a"] - c["b"] for c in history]
    assert diffs[-1] > 3 * bound  # far past the bound, and still climbing
    assert diffs[-1] > 1.8 * diffs[len(diffs) // 2]
    assert sched.policy.service()["b"] == 0.0
    history, longest, most, sched = backlogged_run("dlpm", 0, 3000, quantum, weights, prompts)
    assert worst_excess(history, weights, quantum, longest, most) <= 0
    assert sched.policy.service()["b"] > 0.4 * sched.policy.service()["a"]


# ---- the hit-length memo (KVCacheManager.num_cached_prefix_tokens) ------------------------------


def count_lookups(kv: KVCacheManager) -> list[int]:
    """Count the gpu pool's cache lookups from now on (the returned list's one entry)."""
    calls, lookup = [0], kv.gpu_pool.lookup_packed

    def counted(block_hash, token_bytes):
        calls[0] += 1
        return lookup(block_hash, token_bytes)

    kv.gpu_pool.lookup_packed = counted
    return calls


CACHED_PREFIX_TOKENS = KVCacheManager.num_cached_prefix_tokens  # (tests patch the class)


def unmemoized(kv: KVCacheManager, request) -> int:
    """The hit length walked block by block, as without the memo (which it leaves as it was)."""
    saved, saved_version = kv._hit_memo, kv._hit_memo_version
    kv._hit_memo, kv._hit_memo_version = {}, -1
    try:
        return CACHED_PREFIX_TOKENS(kv, request)
    finally:
        kv._hit_memo, kv._hit_memo_version = saved, saved_version


def test_a_pick_looks_up_a_shared_prefix_once() -> None:
    sched = make_sched("dlpm")
    runner = FakeRunner(VOCAB)
    doc = list(range(1, 34))  # 8 full blocks of 4 and a token (tenant a's: salted by tenant)
    sched.add_request(Request("warm", doc, max_tokens=2, tenant="a"))
    while sched.has_unfinished:
        sched.update_from_output(out := sched.schedule(), runner.execute(out))
    for i in range(10):  # block 8 holds the document's last token and the question: a miss
        question = [100 + 10 * i + j for j in range(6)]
        sched.add_request(Request(f"q{i}", doc + question, max_tokens=1, tenant="a"))
    kv = sched.kv
    calls = count_lookups(kv)
    assert sched.policy.peek() is not None
    # the first request walks 8 hits and the miss; each other one looks up only block 8
    assert calls[0] == 9 + 9 * 1
    calls[0] = 0
    assert [unmemoized(kv, r) for r in sched.policy] == [32] * 10
    assert calls[0] == 10 * 9  # what every pick cost before
    calls[0] = 0
    assert [kv.num_cached_prefix_tokens(r) for r in sched.policy] == [32] * 10
    assert calls[0] == 10  # the memo still holds: nothing entered or left the cache
    other = Request("other", [900] * 40, max_tokens=1, tenant="b")
    sched.add_request(other)
    calls[0] = 0
    assert kv.num_cached_prefix_tokens(other) == 0 and calls[0] == 1
    kv.gpu_pool.reset_cache()  # the cache moved: the memo is dropped
    assert [kv.num_cached_prefix_tokens(r) for r in sched.policy] == [0] * 11


@pytest.mark.parametrize("name", ["lpm", "dlpm"])
@pytest.mark.parametrize("blocks", [96, 40])  # 40: evictions and preemptions every few steps
def test_the_memo_changes_no_hit_length_and_no_decision(name, blocks, monkeypatch) -> None:
    prompts = shared_prefix_prompts(documents(3, WEIGHTS))

    def run(memo: bool) -> tuple[list, int]:
        schedules, lookups = [], []
        schedule, make = Scheduler.schedule, KVCacheManager.__init__

        def recorded(self):
            out = schedule(self)
            schedules.append(dict(out.num_scheduled_tokens))
            return out

        def counted(self, *args, **kw):
            make(self, *args, **kw)
            lookups.append(count_lookups(self))

        with monkeypatch.context() as m:
            m.setattr(Scheduler, "schedule", recorded)
            m.setattr(KVCacheManager, "__init__", counted)
            if not memo:
                m.setattr(KVCacheManager, "num_cached_prefix_tokens", unmemoized)
            *_, sched = backlogged_run(name, 3, 400, 512.0, WEIGHTS, prompts, blocks)
        if memo:  # every answer the policy got equals the block-by-block walk
            kv = sched.kv
            for r in sched.policy:
                assert kv.num_cached_prefix_tokens(r) == unmemoized(kv, r)
        return schedules, sum(c[0] for c in lookups)

    with_memo, memo_lookups = run(True)
    without, plain_lookups = run(False)
    assert with_memo == without  # the same batches, step by step
    assert memo_lookups < plain_lookups
