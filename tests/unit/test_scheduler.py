"""Scheduler: exact block ids, chunked prefill, preemption, priority, random ops, fairness."""

import subprocess
import sys
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fairbatch.kv.manager import KVCacheManager
from fairbatch.policies import FcfsPolicy, PriorityPolicy, TenantSpec, make_policy
from fairbatch.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig
from fairbatch.scheduler.fake_runner import FakeRunner, next_token
from fairbatch.scheduler.preemption import preemption_mode

VOCAB = 1000


def make_sched(
    num_blocks=16,
    block_size=4,
    cpu_blocks=0,
    policy="fcfs",
    tenants=(),
    caching=True,
    **cfg,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, cpu_blocks, enable_prefix_caching=caching)
    cfg.setdefault("max_model_len", 1024)
    return Scheduler(SchedulerConfig(**cfg), kv, make_policy(policy, tenants))


def step(sched: Scheduler, runner: FakeRunner):
    out = sched.schedule()
    return out, sched.update_from_output(out, runner.execute(out))


def reference_tokens(prompt: list[int], n: int, stop=()) -> list[int]:
    tokens, out = list(prompt), []
    for _ in range(n):
        t = next_token(tokens, VOCAB)
        tokens.append(t)
        out.append(t)
        if t in stop:
            break
    return out


def run_to_end(sched: Scheduler, runner: FakeRunner, max_steps=10_000) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished:
            return got
        _, updates = step(sched, runner)
        for u in updates:
            got.setdefault(u.request_id, []).extend(u.new_token_ids)
        sched.check_integrity()
    raise AssertionError("requests did not finish")


def test_exact_blocks_and_chunks_for_two_requests():
    sched = make_sched(num_blocks=8, block_size=4, max_num_batched_tokens=6)
    runner = FakeRunner(VOCAB)
    sched.add_request(Request("a", [1, 2, 3, 4, 5], max_tokens=2))
    sched.add_request(Request("b", [6, 7, 8], max_tokens=1))
    out = sched.schedule()
    # a's 5-token prompt fits the 6-token budget; b gets the 1 token left (chunked prefill).
    assert out.num_scheduled_tokens == {"a": 5, "b": 1}
    assert out.new_block_ids == {"a": [0, 1], "b": [2]}
    assert out.block_tables == {"a": [0, 1], "b": [2]}
    ro = runner.execute(out)
    assert set(ro.sampled_token_ids) == {"a"}  # b's chunk did not reach the end of its prompt
    updates = sched.update_from_output(out, ro)
    assert [(u.request_id, u.finished) for u in updates] == [("a", False)]
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 2}
    assert out.new_block_ids == {}  # both stay inside blocks they already hold
    updates = sched.update_from_output(out, runner.execute(out))
    assert {u.request_id: u.finish_reason for u in updates} == {"a": "length", "b": "length"}
    out = sched.schedule()
    assert out.finished_ids == {"a", "b"} and not out.scheduled
    sched.check_integrity()
    assert sched.kv.all_free()


def test_a_decode_takes_its_next_block_in_the_step_that_writes_it_first():
    sched = make_sched(num_blocks=3, block_size=4, max_num_batched_tokens=16)
    runner = FakeRunner(VOCAB)
    sched.add_request(Request("a", [1, 2, 3], max_tokens=6))
    out, _ = step(sched, runner)  # the prompt: 3 tokens in block 0, one token sampled
    assert out.new_block_ids == {"a": [0]}
    out, _ = step(sched, runner)  # the decode fills block 0
    assert out.new_block_ids == {}
    assert sched.kv.block_ids("a") == [0]
    sched.check_integrity()
    out, _ = step(sched, runner)  # the next token starts block 1
    assert out.new_block_ids == {"a": [1]}
    run_to_end(sched, runner)
    assert sched.kv.all_free()


def test_a_full_block_with_no_free_one_waits_for_schedule_which_preempts():
    sched = make_sched(
        num_blocks=2, block_size=4, max_num_batched_tokens=16, preemption_mode="recompute"
    )
    runner = FakeRunner(VOCAB)
    sched.add_request(Request("a", [1, 2, 3], max_tokens=4))
    sched.add_request(Request("b", [4, 5, 6], max_tokens=4))
    step(sched, runner)
    step(sched, runner)  # both fill their only block; the pool has none left to take
    assert sched.kv.block_ids("a") == [0] and sched.kv.block_ids("b") == [1]
    sched.check_integrity()
    out = sched.schedule()
    assert out.preempted_recompute == ["b"]  # the latest arrival gives way
    assert out.num_scheduled_tokens == {"a": 1} and out.new_block_ids == {"a": [1]}
    sched.update_from_output(out, runner.execute(out))
    b = sched.requests["b"]
    run_to_end(sched, runner)
    assert b.output_token_ids == reference_tokens([4, 5, 6], 4)  # recomputed, resumed
    assert sched.kv.all_free()


def test_outputs_match_reference_and_stop_tokens():
    sched = make_sched(num_blocks=32)
    runner = FakeRunner(VOCAB)
    prompt = [5, 9, 13]
    ref = reference_tokens(prompt, 6)
    sched.add_request(Request("s", prompt, max_tokens=6, stop_token_ids=[ref[2]]))
    sched.add_request(Request("l", [7, 7], max_tokens=5))
    got = run_to_end(sched, runner)
    assert got["s"] == ref[:3]
    assert got["l"] == reference_tokens([7, 7], 5)


def test_prefix_cache_hit_skips_computed_tokens():
    sched = make_sched(num_blocks=16, block_size=4)
    runner = FakeRunner(VOCAB)
    shared = list(range(100, 108))  # two full blocks
    sched.add_request(Request("a", shared + [1], max_tokens=1))
    run_to_end(sched, runner)
    sched.add_request(Request("b", shared + [2, 3], max_tokens=1))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"b": 2}  # 8 of 10 prompt tokens came from the cache
    assert out.block_tables["b"][:2] == [0, 1]


def test_blocks_enter_the_prefix_cache_as_they_fill():
    """Prompt blocks and blocks that decodes fill enter the prefix cache as soon as they are
    full and computed; a later request with that history hits all of them."""
    sched = make_sched(num_blocks=16, block_size=4)
    runner = FakeRunner(VOCAB)
    prompt = list(range(100, 106))  # 1 full prompt block + 2 tokens
    sched.add_request(Request("a", prompt, max_tokens=9))  # 15 tokens: 3 full blocks at the end
    got = [t for u in step(sched, runner)[1] for t in u.new_token_ids]
    assert len(sched.kv.gpu_pool.cached) == 1  # the prompt's full block, right after compute
    for _ in range(4):  # decodes fill block 1 (positions 4-7) and start block 2
        got += [t for u in step(sched, runner)[1] for t in u.new_token_ids]
    assert sched.requests["a"].num_computed_tokens == 10
    assert len(sched.kv.gpu_pool.cached) == 2  # block 1, filled by decodes, right after
    got += run_to_end(sched, runner)["a"]
    assert len(sched.kv.gpu_pool.cached) == 3  # 14 computed tokens: blocks 0-2
    history = prompt + got
    assert got == reference_tokens(prompt, 9)
    hits_before = sched.num_prefix_hit_tokens
    sched.add_request(Request("b", history[:13] + [7], max_tokens=1))
    out = sched.schedule()
    assert sched.num_prefix_hit_tokens - hits_before == 12  # three blocks, two of them decoded
    assert out.num_scheduled_tokens == {"b": 2}
    assert out.block_tables["b"][:3] == [0, 1, 2]


def test_recompute_preemption_when_blocks_run_out():
    # 4 blocks of 4 tokens: two requests each needing 3 blocks cannot both finish.
    sched = make_sched(num_blocks=4, block_size=4, preemption_mode="recompute")
    runner = FakeRunner(VOCAB)
    sched.add_request(Request("a", [1] * 6, max_tokens=6))
    sched.add_request(Request("b", [2] * 6, max_tokens=6))
    got = run_to_end(sched, runner)
    assert sched.num_preemptions["recompute"] >= 1
    assert got["a"] == reference_tokens([1] * 6, 6)
    assert got["b"] == reference_tokens([2] * 6, 6)
    assert sched.kv.all_free()


def test_swap_preemption_maps_and_resume():
    sched = make_sched(num_blocks=4, block_size=4, cpu_blocks=8, preemption_mode="swap")
    runner = FakeRunner(VOCAB)
    sched.add_request(Request("a", [1] * 6, max_tokens=6))
    sched.add_request(Request("b", [2] * 6, max_tokens=6))
    swaps = []
    got: dict[str, list[int]] = {}
    while sched.has_unfinished:
        out, updates = step(sched, runner)
        if out.swap_out or out.swap_in:
            swaps.append((out.preempted_swap, out.swap_out, out.swap_in))
        for u in updates:
            got.setdefault(u.request_id, []).extend(u.new_token_ids)
        sched.check_integrity()
    # The first swap-out: b (latest arrival, same priority and service) gives way.
    first = swaps[0]
    assert first[0] == ["b"] and first[1] == [(2, 0), (3, 1)]
    assert any(s[2] for s in swaps)  # and it came back by swap-in
    assert sched.num_preemptions == {"swap": 1, "recompute": 0}
    assert got["a"] == reference_tokens([1] * 6, 6)
    assert got["b"] == reference_tokens([2] * 6, 6)


def test_swapped_requests_come_back_in_policy_order_before_admissions():
    sched = make_sched(num_blocks=16, block_size=4, cpu_blocks=16)
    runner = FakeRunner(VOCAB)
    prompts = {"a": [1] * 4, "b": [2] * 4, "c": [3] * 4, "d": [4] * 4}
    got: dict[str, list[int]] = {}
    for rid in "abc":
        sched.add_request(Request(rid, prompts[rid], max_tokens=8))
    _, up = step(sched, runner)  # each fills its prompt block
    for u in up:
        got.setdefault(u.request_id, []).extend(u.new_token_ids)
    assert sched.kv.req_block_ids == {"a": [0], "b": [1], "c": [2]}
    assert sched.preempt("b", "swap").swap_out == [(1, 0)]
    assert sched.preempt("a", "swap").swap_out == [(0, 1)]
    assert [r.request_id for r in sched.swapped] == ["b", "a"]  # swapped in the other order
    sched.add_request(Request("d", prompts["d"], max_tokens=8))
    out, up = step(sched, runner)
    for u in up:
        got.setdefault(u.request_id, []).extend(u.new_token_ids)
    # fcfs order (a before b), both before the new arrival; GPU blocks from the free list's
    # head (3..15 never used, then the blocks b and a gave back), each decode's next block
    # taken as it is scheduled
    assert [r.request_id for r in out.scheduled] == ["c", "a", "b", "d"]
    assert out.swap_in == [(1, 4), (0, 6)]
    assert sched.kv.req_block_ids == {"c": [2, 3], "a": [4, 5], "b": [6, 7], "d": [8]}
    for rid, tokens in run_to_end(sched, runner).items():
        got.setdefault(rid, []).extend(tokens)
    assert got == {rid: reference_tokens(p, 8) for rid, p in prompts.items()}


@pytest.mark.parametrize("policy, d_priority, d_runs_at", [("fcfs", 0, 12), ("priority", 2, 10)])
def test_a_swapped_request_that_cannot_come_back_is_not_overtaken(policy, d_priority, d_runs_at):
    """c is swapped out at step 9 and can come back only when a finishes (step 11). d, added
    then, needs one of the two free blocks: under fcfs it waits for c (c precedes it), under
    `priority` it is of a higher class and runs at once."""
    sched = make_sched(
        num_blocks=6, block_size=4, cpu_blocks=8, preemption_mode="swap", policy=policy
    )
    runner = FakeRunner(VOCAB)
    sched.add_request(Request("a", [1] * 4, max_tokens=12))
    sched.add_request(Request("c", [3] * 4, max_tokens=12))
    got: dict[str, list[int]] = {}
    first_step: dict[str, int] = {}
    for i in range(40):
        if not sched.has_unfinished:
            break
        out, up = step(sched, runner)
        for r in out.scheduled:
            first_step.setdefault(r.request_id, i)
        if out.swap_in:
            first_step.setdefault("c back", i)
        for u in up:
            got.setdefault(u.request_id, []).extend(u.new_token_ids)
        if i == 9:
            assert out.preempted_swap == ["c"] and sched.kv.num_free_blocks == 2
            sched.add_request(Request("d", [4] * 2, max_tokens=1, priority=d_priority))
        sched.check_integrity()
    assert first_step["c back"] == 12 and first_step["d"] == d_runs_at
    assert got == {
        "a": reference_tokens([1] * 4, 12),
        "c": reference_tokens([3] * 4, 12),
        "d": reference_tokens([4] * 2, 1),
    }


def test_forced_swap_falls_back_to_recompute_without_cpu_space():
    # As test_recompute_preemption_when_blocks_run_out, but swap is forced and the one CPU
    # block cannot hold a victim's two or three blocks.
    sched = make_sched(num_blocks=4, block_size=4, cpu_blocks=1, preemption_mode="swap")
    runner = FakeRunner(VOCAB)
    sched.add_request(Request("a", [1] * 6, max_tokens=6))
    sched.add_request(Request("b", [2] * 6, max_tokens=6))
    got = run_to_end(sched, runner)
    assert sched.num_preemptions["swap"] == 0 and sched.num_preemptions["recompute"] >= 1
    assert got == {"a": reference_tokens([1] * 6, 6), "b": reference_tokens([2] * 6, 6)}
    # auto mode too: the cost model would swap (fast link, slow prefill), the space says no
    s = make_sched(cpu_blocks=1, swap_bandwidth=1e12, prefill_tokens_per_s=10)
    r = Request("r", [1] * 8, max_tokens=4)
    s.add_request(r)
    step(s, FakeRunner(VOCAB))
    assert len(s.kv.block_ids("r")) == 2 and preemption_mode(s.config, s.kv, r) == "recompute"


def test_preempt_hook_refuses_a_swap_without_cpu_space_and_changes_nothing():
    sched = make_sched(num_blocks=16, block_size=4, cpu_blocks=2)
    runner = FakeRunner(VOCAB)
    sched.add_request(Request("a", [1] * 10, max_tokens=6))
    _, up = step(sched, runner)
    got = list(up.new_tokens.values())
    with pytest.raises(ValueError, match="no CPU swap space for 'a': it holds 3 blocks, 2 are"):
        sched.preempt("a", "swap")
    with pytest.raises(ValueError, match="mode must be"):
        sched.preempt("a", "later")
    assert sched.requests["a"].status == RequestStatus.RUNNING
    assert sched.kv.block_ids("a") == [0, 1, 2]
    sched.check_integrity()
    got += run_to_end(sched, runner)["a"]
    assert got == reference_tokens([1] * 10, 6)
    assert sched.preempt("a", "swap") is None  # finished: nothing to preempt


def test_set_tenant_counters_reorders_admissions():
    def admitted_first(counters: dict[str, float] | None) -> str:
        sched = make_sched(policy="weighted_fair", max_num_seqs=1)
        sched.add_request(Request("a1", [1] * 4, max_tokens=2, tenant="a"))
        sched.add_request(Request("b1", [2] * 4, max_tokens=2, tenant="b"))
        if counters is not None:
            sched.set_tenant_counters(counters)
            assert {t: sched.policy.counters()[t] for t in counters} == counters
        return step(sched, FakeRunner(VOCAB))[0].scheduled[0].request_id

    assert admitted_first(None) == "a1"  # equal counters: the earlier arrival
    assert admitted_first({"a": 100.0}) == "b1"  # a is over-served by the cluster's count
    assert admitted_first({"a": 100.0, "b": 200.0}) == "a1"


def test_auto_mode_prefers_recompute_for_short_and_swap_for_long():
    # Cheap recompute: tiny context, slow link.
    s1 = make_sched(cpu_blocks=8, swap_bandwidth=1e3, prefill_tokens_per_s=1e6)
    r = Request("r", [1] * 8, max_tokens=4)
    s1.add_request(r)
    step(s1, FakeRunner(VOCAB))
    assert preemption_mode(s1.config, s1.kv, r) == "recompute"
    s2 = make_sched(cpu_blocks=8, swap_bandwidth=1e12, prefill_tokens_per_s=10)
    r2 = Request("r", [1] * 8, max_tokens=4)
    s2.add_request(r2)
    step(s2, FakeRunner(VOCAB))
    assert preemption_mode(s2.config, s2.kv, r2) == "swap"


def test_priority_arrival_runs_next_step_when_seats_full():
    sched = make_sched(num_blocks=64, policy="priority", max_num_seqs=2)
    runner = FakeRunner(VOCAB)
    for i in range(2):
        sched.add_request(Request(f"low{i}", [1, 2, 3], max_tokens=50, priority=0))
    step(sched, runner)
    assert len(sched.running) == 2
    sched.add_request(Request("high", [4, 5], max_tokens=3, priority=5))
    out, updates = step(sched, runner)
    assert "high" in out.num_scheduled_tokens
    assert out.preempted_recompute == ["low1"]  # latest arrival among equals gives way
    first = [t for u in updates if u.request_id == "high" for t in u.new_token_ids]
    got = run_to_end(sched, runner)
    assert first + got["high"] == reference_tokens([4, 5], 3)


class PreemptingFcfs(FcfsPolicy):
    name = "custom"
    preempts_lower_classes = True


class NamedPriority(PriorityPolicy):  # the name decides nothing: the declaration does
    preempts_lower_classes = False


@pytest.mark.parametrize(
    "policy, config, preempts",
    [
        (PreemptingFcfs, None, True),
        (NamedPriority, None, False),
        (PreemptingFcfs, False, False),
        (NamedPriority, True, True),
    ],
)
def test_lower_class_preemption_follows_the_declaration(policy, config, preempts):
    kv = KVCacheManager(64, 4, enable_prefix_caching=True)
    cfg = SchedulerConfig(max_num_seqs=1, max_model_len=1024, priority_preemption=config)
    sched = Scheduler(cfg, kv, policy())
    runner = FakeRunner(VOCAB)
    sched.add_request(Request("low", [1, 2, 3], max_tokens=50, priority=0))
    step(sched, runner)
    sched.add_request(Request("high", [4, 5], max_tokens=3, priority=5))
    out, _ = step(sched, runner)
    assert out.preempted_recompute == (["low"] if preempts else [])
    assert ("high" in out.num_scheduled_tokens) == preempts


def test_equal_priority_does_not_preempt():
    sched = make_sched(num_blocks=64, policy="priority", max_num_seqs=1)
    runner = FakeRunner(VOCAB)
    sched.add_request(Request("a", [1], max_tokens=5, priority=1))
    step(sched, runner)
    sched.add_request(Request("b", [2], max_tokens=5, priority=1))
    out, _ = step(sched, runner)
    assert list(out.num_scheduled_tokens) == ["a"] and not out.preempted_recompute


def test_abort_everywhere_frees_blocks():
    sched = make_sched(num_blocks=6, block_size=2, cpu_blocks=8, preemption_mode="swap")
    runner = FakeRunner(VOCAB)
    for i in range(4):
        sched.add_request(Request(f"r{i}", [i + 1] * 3, max_tokens=10))
    for _ in range(4):
        step(sched, runner)
    statuses = {r.status for r in sched.iter_requests()}
    assert RequestStatus.RUNNING in statuses
    for rid in list(sched.requests):
        assert sched.abort(rid)
    assert not sched.abort("r0")
    assert sched.schedule().finished_ids == {"r0", "r1", "r2", "r3"}
    sched.check_integrity()
    assert sched.kv.all_free()


def test_abort_between_schedule_and_update_drops_its_token_only():
    sched = make_sched(num_blocks=8, block_size=4)
    runner = FakeRunner(VOCAB)
    for rid in ("a", "b", "c"):
        sched.add_request(Request(rid, [1, 2, 3], max_tokens=5))
    step(sched, runner)
    out = sched.schedule()  # three plain decodes
    ro = runner.execute(out)
    sampled = dict(ro.sampled_token_ids)
    assert sched.abort("b")
    updates = sched.update_from_output(out, ro)
    assert updates.new_tokens == {r: sampled[r] for r in ("a", "c")}
    assert ro.sampled_token_ids == sampled  # the runner's output is left as it was
    assert [u.request_id for u in updates] == ["a", "c"]
    run_to_end(sched, runner)
    assert sched.kv.all_free()


def test_prompt_too_long_is_rejected():
    sched = make_sched(num_blocks=4, block_size=4)  # 16-token pool caps max_model_len
    with pytest.raises(ValueError, match="limit is 15"):
        sched.add_request(Request("x", list(range(16)), max_tokens=1))
    assert not sched.has_unfinished


def test_length_capped_by_context():
    sched = make_sched(num_blocks=4, block_size=4)  # capacity 16 tokens
    sched.add_request(Request("x", list(range(10)), max_tokens=100))
    got = run_to_end(sched, FakeRunner(VOCAB))
    assert len(got["x"]) == 6


def test_export_import_between_schedulers_swapped_and_recompute():
    runner = FakeRunner(VOCAB)
    a = make_sched(num_blocks=16, block_size=4, cpu_blocks=16)
    b = make_sched(num_blocks=16, block_size=4, cpu_blocks=16)
    prompt = [3, 1, 4, 1, 5]
    a.add_request(Request("m", prompt, max_tokens=8))
    a.add_request(Request("n", [2, 7], max_tokens=8))
    got: dict[str, list[int]] = {}
    for _ in range(3):
        _, ups = step(a, runner)
        for u in ups:
            got.setdefault(u.request_id, []).extend(u.new_token_ids)
    out = a.preempt("m", "swap")
    assert out is not None and out.swap_out
    req, cpu_ids = a.export_request("m")
    assert cpu_ids == [c for _, c in out.swap_out]
    new_ids = b.import_request(req, len(cpu_ids))
    assert new_ids is not None and len(new_ids) == len(cpu_ids)
    a.preempt("n", "recompute")
    req_n, ids_n = a.export_request("n")
    assert ids_n is None
    assert b.import_request(req_n) is None
    a.check_integrity()
    assert a.kv.all_free() and not a.has_unfinished
    for rid, toks in run_to_end(b, runner).items():
        got.setdefault(rid, []).extend(toks)
    assert got["m"] == reference_tokens(prompt, 8)
    assert got["n"] == reference_tokens([2, 7], 8)
    assert b.kv.all_free()


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.integers(1, 20),  # prompt length
            st.integers(1, 12),  # max tokens
            st.integers(0, 2),  # tenant
            st.integers(0, 2),  # priority
            st.lists(st.integers(0, 14), max_size=2),  # stop on the tokens at these positions
        ),
        st.tuples(st.just("step")),
        st.tuples(st.just("step")),
        st.tuples(st.just("abort"), st.integers(0, 30)),
        st.tuples(st.just("preempt"), st.integers(0, 30), st.sampled_from(["swap", "recompute"])),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops,
    policy=st.sampled_from(["fcfs", "round_robin", "weighted_fair", "priority"]),
    mode=st.sampled_from(["auto", "swap", "recompute"]),
    budget=st.integers(1, 24),
    seats=st.integers(1, 6),
    caching=st.booleans(),
)
def test_random_operations_keep_invariants(ops, policy, mode, budget, seats, caching):
    sched = make_sched(
        num_blocks=10,
        block_size=4,
        cpu_blocks=12,
        policy=policy,
        caching=caching,
        preemption_mode=mode,
        max_num_batched_tokens=budget,
        max_num_seqs=seats,
        max_model_len=40,
    )
    runner = FakeRunner(VOCAB)
    expected: dict[str, tuple[list[int], int]] = {}
    aborted: set[str] = set()
    got: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    n = 0

    def collect(updates):
        for u in updates:
            assert u.request_id not in finished, "update after finish"
            got.setdefault(u.request_id, []).extend(u.new_token_ids)
            if u.finished:
                finished[u.request_id] = u.finish_reason

    def checked_step():
        out, updates = step(sched, runner)
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        assert out.total_num_scheduled_tokens <= budget, "over the token budget"
        assert len(out.scheduled) == len(out.num_scheduled_tokens) <= seats
        assert all(n > 0 for n in out.num_scheduled_tokens.values())
        return updates

    for op in ops:
        if op[0] == "add":
            _, plen, max_tokens, tenant, prio, stop_at = op
            prompt = [(n * 7 + j) % 50 for j in range(plen)]
            # stop tokens the request samples (or, past its limit, would have): they end it
            # early, mid-block or on a block boundary, in any step
            undisturbed = reference_tokens(prompt, 15)
            stop = {undisturbed[k] for k in stop_at}
            rid = f"r{n}"
            n += 1
            sched.add_request(
                Request(
                    rid,
                    prompt,
                    max_tokens=max_tokens,
                    tenant=f"t{tenant}",
                    priority=prio,
                    stop_token_ids=stop,
                )
            )
            expected[rid] = (prompt, max_tokens, stop)
        elif op[0] == "step":
            collect(checked_step())
        elif op[0] == "abort":
            rid = f"r{op[1]}"
            if sched.abort(rid):
                aborted.add(rid)
        else:
            preempt_or_refuse(sched, f"r{op[1]}", op[2])
        sched.check_integrity()
    for _ in range(2000):
        if not sched.has_unfinished:
            break
        collect(checked_step())
        sched.check_integrity()
    assert not sched.has_unfinished, "a request never finished"
    assert sched.kv.all_free()
    for rid, (prompt, max_tokens, stop) in expected.items():
        if rid in aborted:
            continue
        limit = min(max_tokens, 40 - len(prompt))
        assert got[rid] == reference_tokens(prompt, limit, stop), rid
        assert finished[rid] == ("stop" if got[rid][-1] in stop else "length"), rid


def preempt_or_refuse(sched: Scheduler, rid: str, mode: str):
    """sched.preempt(rid, mode); a swap with too little CPU space must be refused with a
    ValueError that changes nothing."""
    request = sched.requests.get(rid)
    running = request is not None and request.status == RequestStatus.RUNNING
    if mode == "swap" and running and not sched.kv.can_swap_out(request):
        before = (list(sched.running), dict(sched.kv.req_block_ids), sched.kv.num_free_blocks)
        with pytest.raises(ValueError, match="no CPU swap space"):
            sched.preempt(rid, mode)
        after = (list(sched.running), dict(sched.kv.req_block_ids), sched.kv.num_free_blocks)
        assert after == before and request.status == RequestStatus.RUNNING
        return None
    return sched.preempt(rid, mode)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(
                st.just("add"),
                st.integers(1, 20),
                st.integers(1, 16),
                st.integers(0, 2),
                st.integers(0, 2),
            ),
            st.tuples(st.just("step")),
            st.tuples(st.just("step")),
            st.tuples(st.just("step")),
            st.tuples(st.just("abort"), st.integers(0, 30)),
            st.tuples(st.just("abort_mid_step"), st.integers(0, 30)),
            st.tuples(
                st.just("preempt"), st.integers(0, 30), st.sampled_from(["swap", "recompute"])
            ),
        ),
        min_size=1,
        max_size=80,
    ),
    policy=st.sampled_from(["fcfs", "round_robin", "weighted_fair", "priority"]),
    budget=st.integers(1, 40),
    seats=st.integers(1, 8),
    num_blocks=st.integers(6, 40),
    caching=st.booleans(),
)
def test_random_steps_charge_exactly_the_tokens_delivered(
    ops, policy, budget, seats, num_blocks, caching
):
    """Over random adds, steps, aborts (also between a step's schedule and its update) and
    preemptions, every tenant is charged exactly the decode tokens its requests were handed:
    not a request aborted mid-step, a prefill chunk, nor a request left out of a step."""
    sched = make_sched(
        num_blocks=num_blocks,
        block_size=4,
        cpu_blocks=8,
        policy=policy,
        caching=caching,
        max_num_batched_tokens=budget,
        max_num_seqs=seats,
        max_model_len=min(60, num_blocks * 4),
    )
    runner = FakeRunner(VOCAB)
    delivered: Counter[str] = Counter()  # tokens the updates handed out per tenant
    tenant_of: dict[str, str] = {}
    n = 0
    for op in [*ops, *[("step",)] * 300]:
        if op[0] == "add":
            _, plen, max_tokens, tenant, prio = op
            prompt = [(n * 7 + j) % 50 for j in range(plen)]
            tenant_of[f"r{n}"] = f"t{tenant}"
            if plen < sched.max_model_len:
                sched.add_request(
                    Request(f"r{n}", prompt, max_tokens, tenant=f"t{tenant}", priority=prio)
                )
            n += 1
        elif op[0] in ("step", "abort_mid_step"):
            out = sched.schedule()
            if op[0] == "abort_mid_step" and sched.running:  # between schedule and update
                assert sched.abort(sched.running[op[1] % len(sched.running)].request_id)
            updates = sched.update_from_output(out, runner.execute(out))
            delivered.update(tenant_of[rid] for rid in updates.new_tokens)
        elif op[0] == "abort":
            sched.abort(f"r{op[1]}")
        else:
            preempt_or_refuse(sched, f"r{op[1]}", op[2])
        sched.check_integrity()
    assert not sched.has_unfinished and sched.kv.all_free()
    charged = {t: d for t, (_, d) in sched.policy.tokens().items() if d}
    assert charged == delivered


def _service_run(policy: str, steps: int, weights=(3.0, 1.0), arrivals=(1, 1)):
    """Two continuously backlogged tenants; returns per-step counters and final service."""
    tenants = [TenantSpec("a", weight=weights[0]), TenantSpec("b", weight=weights[1])]
    sched = make_sched(
        num_blocks=64,
        block_size=16,
        policy=policy,
        tenants=tenants,
        max_num_seqs=8,
        max_num_batched_tokens=256,
    )
    runner = FakeRunner(VOCAB)
    n = 0
    queued = {"a": 0, "b": 0}

    def top_up():
        nonlocal n
        # Arrivals in the ratio `arrivals` keep both queues non-empty (continuously backlogged).
        while queued["a"] < 20 * arrivals[0] or queued["b"] < 20 * arrivals[1]:
            for tenant, k in (("a", arrivals[0]), ("b", arrivals[1])):
                for _ in range(k):
                    n += 1
                    sched.add_request(
                        Request(f"{tenant}{n}", [n % 97 + 1] * 32, max_tokens=32, tenant=tenant)
                    )
                    queued[tenant] += 1

    history = []
    admitted: set[str] = set()
    for _ in range(steps):
        top_up()
        out, _ = step(sched, runner)
        for r in out.scheduled:
            if r.request_id not in admitted:
                admitted.add(r.request_id)
                queued[r.tenant] -= 1
        history.append(dict(sched.policy.counters()))
    return history, sched.policy.service(), sched


def vtc_bound(
    sched: Scheduler, w_in=1.0, w_out=2.0, max_input=32, max_len=64, min_weight=1.0
) -> float:
    """VTC (Sheng et al., OSDI'24, Thm. 4.4): two backlogged clients' counters differ by at
    most 2*max(w_in*L_input, w_out*M), M the most tokens a running batch holds: the KV pool,
    or less when every seat (max_num_seqs) holds a request of the longest length (`max_len`,
    prompt + output). Counters are service / weight, so the bound is divided by the smallest
    weight."""
    pool = sched.kv.gpu_pool.num_blocks * sched.kv.block_size
    m = min(pool, sched.config.max_num_seqs * max_len)
    return 2 * max(w_in * max_input, w_out * m) / min_weight


def test_weighted_fair_stays_within_vtc_bound_and_weights():
    history, service, sched = _service_run("weighted_fair", 3000)
    bound = vtc_bound(sched)
    assert bound == 2 * 2.0 * 8 * 64  # the seats bind here: 8 x 64 tokens < the pool's 1,024
    worst = max(abs(c.get("a", 0) - c.get("b", 0)) for c in history)
    assert worst <= bound, (worst, bound)
    ratio = service["a"] / service["b"]
    assert abs(ratio / 3.0 - 1) <= 0.05, ratio


def test_fcfs_difference_grows_without_bound():
    # Tenant a sends 3 requests for every 1 of b, equal weights: FCFS serves by arrival.
    history, _, sched = _service_run("fcfs", 3000, weights=(1.0, 1.0), arrivals=(3, 1))
    bound = vtc_bound(sched)
    diffs = [abs(c.get("a", 0) - c.get("b", 0)) for c in history]
    assert diffs[-1] > 3 * bound  # far past the bound, and still climbing
    assert diffs[-1] > 1.8 * diffs[len(diffs) // 2]
    wf_hist, _, _ = _service_run("weighted_fair", 3000, weights=(1.0, 1.0), arrivals=(3, 1))
    assert max(abs(c.get("a", 0) - c.get("b", 0)) for c in wf_hist) <= bound


def test_pure_python_modules_import_without_torch_or_ray():
    code = (
        "import sys; import fairbatch.scheduler, fairbatch.policies, fairbatch.kv;"
        "import fairbatch.kv.block_pool, fairbatch.kv.manager, fairbatch.scheduler.fake_runner;"
        "bad = [m for m in ('torch', 'ray', 'numpy') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "policy, expected",
    [
        # one seat: each admission goes to the next backlogged tenant in the cycle
        ("round_robin", ["a1", "b1", "a2", "b2", "a3", "b3", "a4", "a5"]),
        ("fcfs", ["a1", "a2", "a3", "a4", "a5", "b1", "b2", "b3"]),
    ],
)
def test_admission_order_follows_the_policy(policy: str, expected: list[str]) -> None:
    """Admission takes the policy's head by `remove(served=True)`: round robin must move on to
    the next tenant after every admission (it starved b when admissions didn't count as served)."""
    sched = make_sched(
        num_blocks=64, policy=policy, tenants=[TenantSpec("a"), TenantSpec("b")], max_num_seqs=1
    )
    runner = FakeRunner(VOCAB)
    for name in ["a1", "a2", "a3", "a4", "a5", "b1", "b2", "b3"]:
        sched.add_request(Request(name, [1, 2, 3], max_tokens=2, tenant=name[0]))
    admitted: list[str] = []
    for _ in range(100):
        if not sched.has_unfinished:
            break
        out, _ = step(sched, runner)
        admitted += [r.request_id for r in out.scheduled if r.request_id not in admitted]
    assert admitted == expected


def test_output_tokens_is_a_live_read_only_view_of_the_token_lists_tail():
    r = Request("v", [7, 8, 9], max_tokens=4)
    out = r.output_token_ids
    assert out == [] and len(out) == 0 and r.num_output_tokens == 0
    r.append_output_token(11)
    r.append_output_token(12)
    r.append_output_token(13)
    # the view taken before the appends sees them; the prompt is not part of it
    assert out == [11, 12, 13] and out == (11, 12, 13) and out != [11, 12]
    assert list(out) == [11, 12, 13] and r.num_output_tokens == 3
    assert (out[0], out[2], out[-1], out[-3]) == (11, 13, 13, 11)
    assert out[1:] == [12, 13] and out[::-1] == [13, 12, 11]
    for bad in (3, -4):
        with pytest.raises(IndexError):
            out[bad]
    assert 12 in out and 9 not in out and out.index(13) == 2
    assert r.all_token_ids == [7, 8, 9, 11, 12, 13]
    assert not hasattr(out, "append")


def test_request_rejects_token_ids_outside_uint32():
    Request("ok", [0, 2**32 - 1], max_tokens=1)  # the whole range the prefix cache packs
    for bad in ([-1, 5], [5, 2**32]):
        with pytest.raises(ValueError, match="token ids must be in"):
            Request("bad", bad, max_tokens=1)


def test_request_takes_its_prompt_from_any_iterable_once():
    r = Request("g", (t for t in [3, 4, 5]), max_tokens=2)
    assert r.prompt_token_ids == [3, 4, 5] and r.all_token_ids == [3, 4, 5]
    assert r.prompt_token_ids is not r.all_token_ids  # the prompt stays as given


@pytest.mark.parametrize("order", ["preempt first", "request first"])
def test_a_seat_given_away_by_the_controller_is_kept_for_its_request(order):
    """The controller preempts `a` for `q` (seats.py): whichever of the two calls comes first,
    the freed seat goes to `q`, not to the swapped victim nor to `w`, queued earlier; `a`
    resumes once a seat frees, with the tokens it would have made undisturbed."""
    sched = make_sched(num_blocks=32, block_size=4, cpu_blocks=32, max_num_seqs=2)
    runner = FakeRunner(VOCAB)
    sched.add_request(Request("a", [1] * 6, max_tokens=8))
    sched.add_request(Request("b", [2] * 6, max_tokens=8))
    got: dict[str, list[int]] = {}

    def run(n: int) -> list[list[str]]:
        ran = []
        for _ in range(n):
            out, updates = step(sched, runner)
            ran.append(sorted(r.request_id for r in out.scheduled))
            for u in updates:
                got.setdefault(u.request_id, []).extend(u.new_token_ids)
            sched.check_integrity()
        return ran

    run(2)
    sched.add_request(Request("w", [3] * 5, max_tokens=2))  # waits: both seats taken
    if order == "request first":
        sched.add_request(Request("q", [4] * 5, max_tokens=2))
    assert sched.preempt("a", "swap", seat_for="q") is not None
    if order == "preempt first":
        assert run(1) == [["b"]]  # the seat stays empty until q arrives
        sched.add_request(Request("q", [4] * 5, max_tokens=2))
    assert run(1) == [["b", "q"]]
    assert not sched.kept_seats
    for rid, tokens in run_to_end(sched, runner).items():
        got.setdefault(rid, []).extend(tokens)
    assert got["a"] == reference_tokens([1] * 6, 8)
    assert got["q"] == reference_tokens([4] * 5, 2)


def test_a_kept_seats_prompt_goes_before_running_prefill_chunks():
    """`q` gets `a`'s seat (the controller preempted `a` for it) while `long` is mid-prefill:
    `q`'s prompt is in this step, `long`'s chunk takes what is left after it and after `d`'s
    next token, and every output is still the undisturbed one."""
    sched = make_sched(
        num_blocks=64, block_size=4, cpu_blocks=16, max_num_seqs=3, max_num_batched_tokens=16
    )
    runner = FakeRunner(VOCAB)
    got: dict[str, list[int]] = {}

    def run() -> dict[str, int]:
        out, updates = step(sched, runner)
        for u in updates:
            got.setdefault(u.request_id, []).extend(u.new_token_ids)
        sched.check_integrity()
        return dict(out.num_scheduled_tokens)

    sched.add_request(Request("d", [1] * 4, max_tokens=20))
    sched.add_request(Request("a", [2] * 4, max_tokens=20))
    assert run() == {"d": 4, "a": 4}
    sched.add_request(Request("long", [3] * 40, max_tokens=4))
    assert run() == {"d": 1, "a": 1, "long": 14}
    assert sched.preempt("a", "swap", seat_for="q") is not None
    sched.add_request(Request("q", [4] * 6, max_tokens=3))
    assert run() == {"d": 1, "long": 9, "q": 6}  # without the reserve: long 15, q waits
    assert not sched.kept_seats
    for rid, tokens in run_to_end(sched, runner).items():
        got.setdefault(rid, []).extend(tokens)
    assert got["q"] == reference_tokens([4] * 6, 3)
    assert got["long"] == reference_tokens([3] * 40, 4)
    assert got["a"] == reference_tokens([2] * 4, 20)
    assert got["d"] == reference_tokens([1] * 4, 20)


def test_a_kept_seat_is_given_back_when_its_request_never_comes():
    now = [0.0]
    kv = KVCacheManager(32, 4, 32)
    sched = Scheduler(
        SchedulerConfig(max_model_len=1024, max_num_seqs=1), kv, make_policy("fcfs", ()),
        clock=lambda: now[0],
    )  # fmt: skip
    runner = FakeRunner(VOCAB)
    sched.add_request(Request("a", [1] * 6, max_tokens=6))
    step(sched, runner)
    sched.preempt("a", "swap", seat_for="gone")
    assert step(sched, runner)[0].scheduled == []  # kept for "gone"
    now[0] += sched.kept_seats.hold_s + 0.1
    assert [r.request_id for r in step(sched, runner)[0].scheduled] == ["a"]
    assert not sched.kept_seats
