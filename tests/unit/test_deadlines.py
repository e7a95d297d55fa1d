"""Deadlines in the scheduler: eviction at exact steps, freed blocks, edf order, the VTC bound."""

import math
import random

import pytest

from fairbatch.engine.core import EngineCore, MigratedRequest
from fairbatch.engine.sampling_params import SamplingParams
from fairbatch.kv.manager import KVCacheManager
from fairbatch.policies import TenantSpec, make_policy
from fairbatch.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig
from fairbatch.scheduler.fake_runner import FakeRunner
from tests.unit.test_scheduler import VOCAB, reference_tokens, step, vtc_bound


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(clock, policy="fcfs", tenants=(), within="fcfs", num_blocks=16, **cfg) -> Scheduler:
    kv = KVCacheManager(num_blocks, 4, 0, enable_prefix_caching=True)
    cfg.setdefault("max_model_len", 1024)
    policy = make_policy(policy, tenants, clock=clock, order_within_tenant=within)
    return Scheduler(SchedulerConfig(**cfg), kv, policy)


def test_a_waiting_request_leaves_at_its_queue_deadline_without_taking_a_block():
    clock = FakeClock()
    sched = make(clock, max_num_seqs=1)
    runner = FakeRunner(VOCAB)
    sched.add_request(Request("a", [1] * 6, max_tokens=20))
    sched.add_request(Request("b", [2] * 3, max_tokens=4, queue_deadline=2.0))
    for t in (0.0, 1.0, 1.5):  # b has no seat, and its deadline is not reached
        clock.now = t
        out, _ = step(sched, runner)
        assert out.timed_out == {} and [r.request_id for r in out.scheduled] == ["a"]
    free_before = sched.kv.num_free_blocks
    clock.now = 2.0
    out, updates = step(sched, runner)
    assert out.timed_out == {"b": ("default", "queue")}
    assert "b" in out.finished_ids and "b" not in sched.requests
    taken = len(out.new_block_ids.get("a", ()))  # (a's next block, if its decode needed one)
    assert sched.kv.block_ids("b") == [] and sched.kv.num_free_blocks == free_before - taken
    assert sched.num_timed_out == {"queue": 1, "running": 0}
    assert sched.policy.tokens()["default"] == (6, 4)  # a only: b computed nothing
    sched.check_integrity()


def test_a_running_request_ends_at_its_deadline_and_frees_exactly_its_blocks():
    clock = FakeClock()
    sched = make(clock, num_blocks=8)
    runner = FakeRunner(VOCAB)
    prompt = [5, 6, 7, 8, 9, 10]
    sched.add_request(Request("a", prompt, max_tokens=20, deadline=3.0))
    sched.add_request(Request("b", [3] * 4, max_tokens=20))
    got = []
    for t in (0.0, 1.0, 2.0, 2.9):
        clock.now = t
        _, updates = step(sched, runner)
        got += [tok for u in updates if u.request_id == "a" for tok in u.new_token_ids]
    assert got == reference_tokens(prompt, 4)  # 6 prompt + 4 output tokens: 10 in 3 blocks
    assert sched.kv.block_ids("a") == [0, 1, 4]  # b holds 2 and 3 (its prompt filled 2)
    free_before = sched.kv.num_free_blocks
    clock.now = 3.0
    out = sched.schedule()  # the step boundary: a leaves before anything is scheduled
    assert out.timed_out == {"a": ("default", "running")}
    assert [r.request_id for r in out.scheduled] == ["b"]
    assert sched.kv.num_free_blocks == free_before + 3
    assert sched.kv.block_ids("a") == []
    sched.update_from_output(out, runner.execute(out))
    # charged for what it computed: 6 prompt + 4 decode tokens (b: 4 prompt + 5 decode)
    assert sched.policy.tokens()["default"] == (10, 9)
    # its two full blocks (positions 0..7) went to the prefix cache, as for any finish
    sched.add_request(Request("c", prompt + got[:2] + [1], max_tokens=1))
    out = sched.schedule()
    assert sched.kv.block_ids("c")[:2] == [0, 1]
    assert sched.requests["c"].num_computed_tokens == 8
    sched.check_integrity()


def test_the_queue_deadline_no_longer_holds_once_a_request_was_scheduled():
    clock = FakeClock()
    sched = make(clock, num_blocks=4, preemption_mode="recompute")
    runner = FakeRunner(VOCAB)
    sched.add_request(Request("a", [1] * 4, max_tokens=8, queue_deadline=1.0, deadline=10.0))
    step(sched, runner)
    assert sched.preempt("a", "recompute") is not None  # back to waiting, after it started
    clock.now = 5.0
    out, updates = step(sched, runner)
    assert out.timed_out == {} and [r.request_id for r in out.scheduled] == ["a"]
    clock.now = 10.0
    out, _ = step(sched, runner)
    assert out.timed_out == {"a": ("default", "running")}
    sched.check_integrity()


def test_a_swapped_request_past_its_deadline_leaves_from_the_swap_space():
    clock = FakeClock()
    kv = KVCacheManager(8, 4, 8, enable_prefix_caching=True)
    policy = make_policy("fcfs", clock=clock)
    sched = Scheduler(SchedulerConfig(max_model_len=64), kv, policy)
    runner = FakeRunner(VOCAB)
    sched.add_request(Request("a", [1] * 5, max_tokens=8, deadline=4.0))
    step(sched, runner)
    sched.preempt("a", "swap")
    assert sched.requests["a"].status == RequestStatus.SWAPPED
    free_cpu = kv.cpu_pool.num_free_blocks
    clock.now = 4.0
    out = sched.schedule()
    assert out.timed_out == {"a": ("default", "running")} and out.swap_in == []
    assert kv.cpu_pool.num_free_blocks == free_cpu + 2
    sched.check_integrity()


def test_the_engine_reports_timeout_with_the_tokens_so_far_and_moves_keep_deadlines():
    clock = FakeClock()
    engine = EngineCore(make(clock), FakeRunner(VOCAB))
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=20, timeout=2.0), request_id="a")
    engine.add_request([4, 5], SamplingParams(max_tokens=20, max_queue_time_s=1.0), request_id="b")
    request = engine.scheduler.requests["a"]
    assert (request.deadline, request.queue_deadline) == (2.0, math.inf)
    deltas = []
    for t in (0.0, 1.0, 2.0):
        clock.now = t
        deltas += engine.step()
    a = [d for d in deltas if d.request_id == "a"]
    assert [len(d.token_ids) for d in a] == [1, 1, 0]
    assert a[-1].finished and a[-1].finish_reason == "timeout"
    assert engine.timed_out == {("default", "running"): 1}
    assert "b" in engine.scheduler.requests  # scheduled at t=0: its queue deadline is moot
    # a move: the deadline leaves as wall-clock time and arrives in the new clock
    engine.add_request([7], SamplingParams(max_tokens=4, timeout=5.0), request_id="m")
    moved = engine.export_request("m")
    other_clock = FakeClock()
    other_clock.now = 100.0
    other = EngineCore(make(other_clock), FakeRunner(VOCAB))
    other.import_request(MigratedRequest(moved.request, None, moved.extra))
    # added at t=2 with 5 s, moved at once: 5 s left in a clock that reads 100
    assert other.scheduler.requests["m"].deadline == pytest.approx(105.0, abs=0.05)


def test_edf_starts_a_tenants_requests_in_deadline_order():
    clock = FakeClock()
    tenants = [TenantSpec("a"), TenantSpec("b")]
    sched = make(clock, "weighted_fair", tenants, "edf", num_blocks=64, max_num_seqs=1)
    runner = FakeRunner(VOCAB)
    deadlines = {"a1": 50.0, "a2": 20.0, "a3": math.inf, "a4": 30.0, "b1": 40.0, "b2": 10.0}
    for rid, d in deadlines.items():
        sched.add_request(Request(rid, [1, 2], max_tokens=2, tenant=rid[0], deadline=d))
    started = []
    while sched.has_unfinished:
        out, _ = step(sched, runner)
        started += [r.request_id for r in out.scheduled if r.request_id not in started]
    assert [r for r in started if r[0] == "a"] == ["a2", "a4", "a1", "a3"]
    assert [r for r in started if r[0] == "b"] == ["b2", "b1"]


def test_bad_order_within_tenant_is_refused():
    with pytest.raises(ValueError, match="order_within_tenant"):
        make_policy("weighted_fair", order_within_tenant="sjf")


@pytest.mark.parametrize("within", ["fcfs", "edf"])
def test_vtc_bound_holds_at_every_step_with_edf(within):
    """Two continuously backlogged tenants (weights 3:1), each request with a random deadline
    far enough out that none is evicted: edf reorders inside a tenant, the counters stay within
    the VTC bound and the service ratio is the weights'."""
    clock = FakeClock()
    tenants = [TenantSpec("a", weight=3.0), TenantSpec("b", weight=1.0)]
    kv = KVCacheManager(64, 16, 0, enable_prefix_caching=True)
    policy = make_policy("weighted_fair", tenants, clock=clock, order_within_tenant=within)
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024)
    sched = Scheduler(cfg, kv, policy)
    runner = FakeRunner(VOCAB)
    rng = random.Random(7)
    queued = {"a": set(), "b": set()}
    n, worst = 0, 0.0
    for _ in range(2000):
        for tenant, ids in queued.items():
            while len(ids) < 20:
                n += 1
                rid = f"{tenant}{n}"
                deadline = 1e6 + rng.uniform(0, 1e3)
                request = Request(rid, [n % 97 + 1] * 32, 32, tenant=tenant, deadline=deadline)
                sched.add_request(request)
                ids.add(rid)
        out, _ = step(sched, runner)
        for r in out.scheduled:
            queued[r.tenant].discard(r.request_id)
        counters = sched.policy.counters()
        worst = max(worst, abs(counters["a"] - counters["b"]))
        clock.now += 0.01
    assert worst <= vtc_bound(sched), (worst, vtc_bound(sched))
    service = sched.policy.service()
    assert abs(service["a"] / service["b"] / 3.0 - 1) <= 0.05
    assert sched.num_timed_out == {"queue": 0, "running": 0}
