"""Parallel sampling in the scheduler: siblings forked from their parent's prompt blocks.

Exact block ids, reference counts and copy pairs after a fork; held siblings released when the
parent leaves; fallbacks (no seat); preempted siblings; the prompt charged once. The fake
runner's next token depends on the tokens only, so every sample of a prompt must produce
exactly the reference tokens whatever happened to its blocks.
"""

import random

import pytest

from fairbatch.kv.manager import KVCacheManager
from fairbatch.policies import make_policy
from fairbatch.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig
from fairbatch.scheduler.fake_runner import FakeRunner, next_token

VOCAB = 1000


def make_sched(num_blocks=16, block_size=4, cpu_blocks=8, **cfg) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, cpu_blocks)
    cfg.setdefault("max_model_len", 256)
    return Scheduler(SchedulerConfig(**cfg), kv, make_policy("fcfs", ()))


def reference(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens, VOCAB))
    return tokens[len(prompt) :]


def add_samples(sched: Scheduler, rid: str, prompt: list[int], n: int, max_tokens=4) -> None:
    sched.add_request(Request(rid, prompt, max_tokens))
    for i in range(1, n):
        sched.add_request(Request(f"{rid}.{i}", prompt, max_tokens), fork_of=rid)


def step(sched: Scheduler, runner: FakeRunner, got: dict[str, list[int]]):
    out = sched.schedule()
    for u in sched.update_from_output(out, runner.execute(out)):
        got.setdefault(u.request_id, []).extend(u.new_token_ids)
    return out


def run_to_end(sched: Scheduler, runner: FakeRunner, got=None) -> dict[str, list[int]]:
    got = {} if got is None else got
    for _ in range(1000):
        if not sched.has_unfinished:
            sched.schedule()  # hand out the last finished ids
            sched.check_integrity()
            assert sched.kv.all_free()
            return got
        step(sched, runner, got)
        sched.check_integrity()
    raise AssertionError("requests did not finish")


def refs(sched: Scheduler) -> dict[int, int]:
    return {b.block_id: b.ref_cnt for b in sched.kv.gpu_pool.blocks if b.ref_cnt}


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    sched, runner, got = make_sched(), FakeRunner(VOCAB), {}
    prompt = [1, 2, 3, 4, 5, 6]  # L = 6: positions 0..3 in block 0, 4..5 in block 1
    add_samples(sched, "a", prompt, 3)
    assert sched.num_waiting == 1  # the siblings are held, not queued
    out = step(sched, runner, got)
    assert out.num_scheduled_tokens == {"a": 6}
    assert out.block_tables["a"] == [0, 1]
    # forked as the parent's prefill completed: block 0 shared, block 1 (position 5) copied
    assert sched.kv.block_ids("a.1") == [0, 2]
    assert sched.kv.block_ids("a.2") == [0, 3]
    assert refs(sched) == {0: 3, 1: 1, 2: 1, 3: 1}
    for rid in ("a.1", "a.2"):
        r = sched.requests[rid]
        assert r.status == RequestStatus.RUNNING
        assert r.num_computed_tokens == 5
    sched.check_integrity()
    out = step(sched, runner, got)
    assert out.copy_blocks == [(1, 2), (1, 3)]
    # each sibling computes only its last prompt token, which gives its first sample
    assert out.num_scheduled_tokens == {"a": 1, "a.1": 1, "a.2": 1}
    assert out.new_block_ids == {}
    assert sched.num_forks == 2
    got = run_to_end(sched, runner, got)
    assert got == {rid: reference(prompt, 4) for rid in ("a", "a.1", "a.2")}


def test_fork_when_the_last_prompt_token_starts_a_block_copies_nothing():
    sched, runner, got = make_sched(), FakeRunner(VOCAB), {}
    prompt = list(range(10, 19))  # L = 9: positions < 8 fill blocks 0 and 1 exactly
    add_samples(sched, "a", prompt, 3)
    step(sched, runner, got)
    assert sched.kv.block_ids("a") == [0, 1, 2]
    assert sched.kv.block_ids("a.1") == [0, 1]
    assert sched.kv.block_ids("a.2") == [0, 1]
    assert refs(sched) == {0: 3, 1: 3, 2: 1}
    out = step(sched, runner, got)
    assert out.copy_blocks == []
    assert out.new_block_ids == {"a.1": [3], "a.2": [4]}  # position 8: a block of its own
    assert run_to_end(sched, runner, got) == {
        rid: reference(prompt, 4) for rid in ("a", "a.1", "a.2")
    }


def test_a_parent_that_finishes_at_once_forks_before_freeing():
    sched, runner, got = make_sched(), FakeRunner(VOCAB), {}
    prompt = [7, 8, 9, 10, 11, 12]
    sched.add_request(Request("a", prompt, 1))
    sched.add_request(Request("b", prompt, 3), fork_of="a")
    step(sched, runner, got)
    assert "a" not in sched.requests
    assert sched.kv.block_ids("b") == [0, 2]
    assert refs(sched) == {0: 1, 2: 1}  # block 1, the copy's source, is free again
    out = step(sched, runner, got)
    assert out.copy_blocks == [(1, 2)]  # issued before any reuse of block 1 (runner order)
    got = run_to_end(sched, runner, got)
    assert got == {"a": reference(prompt, 1), "b": reference(prompt, 3)}


def test_a_sibling_added_after_the_parent_prefill_forks_at_once():
    sched, runner, got = make_sched(), FakeRunner(VOCAB), {}
    prompt = [3, 1, 4, 1, 5, 9, 2]
    sched.add_request(Request("a", prompt, 5))
    step(sched, runner, got)
    step(sched, runner, got)
    sched.add_request(Request("b", prompt, 5), fork_of="a")
    assert sched.requests["b"].status == RequestStatus.RUNNING
    assert sched.kv.block_ids("a") == [0, 1]  # its first decode filled block 1
    assert sched.kv.block_ids("b") == [0, 2]  # a copy of block 1: positions 4..5 are the prompt
    assert step(sched, runner, got).copy_blocks == [(1, 2)]
    got = run_to_end(sched, runner, got)
    assert got == {"a": reference(prompt, 5), "b": reference(prompt, 5)}


@pytest.mark.parametrize("when", ["before any step", "mid prefill"])
def test_held_siblings_join_the_queue_when_the_parent_is_aborted(when):
    sched, runner, got = make_sched(max_num_batched_tokens=4), FakeRunner(VOCAB), {}
    prompt = list(range(20, 30))  # 10 tokens: three chunks of 4
    add_samples(sched, "a", prompt, 3)
    if when == "mid prefill":
        step(sched, runner, got)
        assert sched.requests["a"].num_computed_tokens == 4
    sched.check_integrity()
    assert sched.abort("a")
    assert sched.num_waiting == 2
    assert all(sched.requests[r].fork_of is None for r in ("a.1", "a.2"))
    sched.check_integrity()
    got = run_to_end(sched, runner, got)
    assert got == {"a.1": reference(prompt, 4), "a.2": reference(prompt, 4)}
    assert sched.num_forks == 0


def test_aborting_a_held_sibling_leaves_the_others_held():
    sched, runner, got = make_sched(), FakeRunner(VOCAB), {}
    prompt = [5, 6, 7, 8, 9]
    add_samples(sched, "a", prompt, 3)
    assert sched.abort("a.1")
    sched.check_integrity()
    got = run_to_end(sched, runner, got)
    assert got == {"a": reference(prompt, 4), "a.2": reference(prompt, 4)}
    assert sched.num_forks == 1


def test_without_a_seat_siblings_run_as_ordinary_requests_on_cached_blocks():
    sched, runner, got = make_sched(max_num_seqs=1), FakeRunner(VOCAB), {}
    prompt = list(range(40, 49))
    add_samples(sched, "a", prompt, 3)
    got = run_to_end(sched, runner, got)
    assert got == {rid: reference(prompt, 4) for rid in ("a", "a.1", "a.2")}
    assert sched.num_forks == 0
    assert sched.num_prefix_hit_tokens == 2 * 8  # two full prompt blocks each
    assert sched.policy.tokens()["default"] == (9, 3 * 4)  # the prompt charged once


@pytest.mark.parametrize("n", [1, 3])
def test_the_tenant_is_charged_the_prompt_once(n):
    sched, runner = make_sched(), FakeRunner(VOCAB)
    prompt = list(range(60, 71))
    add_samples(sched, "a", prompt, n)
    run_to_end(sched, runner)
    assert sched.policy.tokens()["default"] == (len(prompt), n * 4)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_a_preempted_sibling_produces_the_same_tokens(mode):
    sched, runner, got = make_sched(), FakeRunner(VOCAB), {}
    prompt = [9, 8, 7, 6, 5, 4]
    add_samples(sched, "a", prompt, 3, max_tokens=6)
    step(sched, runner, got)
    out = sched.preempt("a.1", mode)  # before its first step: its copy is still pending
    assert out.copy_blocks == [(1, 2), (1, 3)]
    if mode == "swap":
        assert out.swap_out == [(0, 0), (2, 1)]  # its own CPU copy of the shared block too
    assert refs(sched) == {0: 2, 1: 1, 3: 1}  # its references dropped, the parent's kept
    sched.check_integrity()
    assert step(sched, runner, got).copy_blocks == []
    step(sched, runner, got)
    sched.preempt("a.2", mode)  # after it sampled
    got = run_to_end(sched, runner, got)
    assert got == {rid: reference(prompt, 6) for rid in ("a", "a.1", "a.2")}
    assert sched.policy.tokens()["default"] == (len(prompt), 3 * 6)


def test_siblings_stay_held_while_the_parent_is_preempted_mid_prefill():
    sched, runner, got = make_sched(max_num_batched_tokens=4), FakeRunner(VOCAB), {}
    prompt = list(range(80, 90))
    add_samples(sched, "a", prompt, 2)
    step(sched, runner, got)
    sched.preempt("a", "recompute")
    assert sched.requests["a.1"].fork_of == "a"
    sched.check_integrity()
    got = run_to_end(sched, runner, got)
    assert got == {rid: reference(prompt, 4) for rid in ("a", "a.1")}
    assert sched.num_forks == 1


def test_fork_of_must_name_the_same_prompt_and_tenant():
    sched = make_sched()
    sched.add_request(Request("a", [1, 2, 3], 2))
    with pytest.raises(ValueError, match="another prompt or tenant"):
        sched.add_request(Request("b", [1, 2, 4], 2), fork_of="a")
    with pytest.raises(ValueError, match="another prompt or tenant"):
        sched.add_request(Request("c", [1, 2, 3], 2, tenant="t2"), fork_of="a")
    sched.add_request(Request("d", [1, 2, 3], 2), fork_of="gone")  # unknown: ordinary request
    assert sched.num_waiting == 2
    sched.check_integrity()


@pytest.mark.parametrize("seed", range(6))
def test_random_forks_aborts_and_preemptions_keep_the_accounting_exact(seed):
    rng = random.Random(seed)
    sched = make_sched(
        num_blocks=24,
        cpu_blocks=rng.choice([0, 12]),
        max_num_seqs=rng.choice([2, 4, 8]),
        max_num_batched_tokens=rng.choice([3, 8, 64]),
    )
    runner, got = FakeRunner(VOCAB), {}
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 13))] for _ in range(4)]
    expected: dict[str, list[int]] = {}
    aborted: set[str] = set()
    for t in range(120):
        op = rng.random()
        if op < 0.15:
            prompt, n, max_tokens = rng.choice(prompts), rng.randint(1, 4), rng.randint(1, 8)
            add_samples(sched, f"g{t}", prompt, n, max_tokens)
            for rid in [f"g{t}"] + [f"g{t}.{i}" for i in range(1, n)]:
                expected[rid] = reference(prompt, max_tokens)
        elif op < 0.2 and sched.requests:
            rid = rng.choice(sorted(sched.requests))
            sched.abort(rid)
            aborted.add(rid)
        elif op < 0.3 and sched.running:
            mode = rng.choice(["swap", "recompute", "auto"])
            rid = rng.choice(sched.running).request_id
            try:
                out = sched.preempt(rid, mode)
            except ValueError:  # no CPU space for a swap
                continue
            runner.execute(out)
        else:
            step(sched, runner, got)
        sched.check_integrity()
    run_to_end(sched, runner, got)
    for rid, tokens in expected.items():
        if rid not in aborted:
            assert got[rid] == tokens, rid
        else:
            assert got.get(rid, []) == tokens[: len(got.get(rid, []))]
