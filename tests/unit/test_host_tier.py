"""The prefix cache's host tier (kv/manager.py): exact block ids of stores, lookups and loads,
the salt, LRU within tenant shares, swap and tier in one host pool, and the step a request
with host hits loads in (scheduler)."""

import pytest

from fairbatch.kv import KVCacheManager
from fairbatch.policies import TenantSpec, make_policy
from fairbatch.scheduler import Scheduler, SchedulerConfig
from fairbatch.scheduler.output import RunnerOutput
from fairbatch.scheduler.request import Request


def make_req(rid: str, tokens: list[int], tenant: str = "a", salt: str | None = None) -> Request:
    return Request(rid, tokens, max_tokens=8, tenant=tenant, cache_salt=salt)


def compute(kv: KVCacheManager, r: Request) -> None:
    """Allocate and 'compute' all of r's tokens, then free it: its full blocks stay cached."""
    assert kv.allocate_slots(r, r.num_tokens) is not None
    r.num_computed_tokens = r.num_tokens
    kv.free(r)


def host_order(kv: KVCacheManager) -> list[int]:
    return [b.block_id for b in kv.cpu_pool.free_queue]


def tiered(num_gpu: int = 4, num_cpu: int = 4) -> KVCacheManager:
    return KVCacheManager(num_gpu, block_size=2, num_cpu_blocks=num_cpu, host_tier=True)


def test_an_evicted_block_is_stored_once_and_loaded_back():
    kv = tiered(num_cpu=8)
    compute(kv, make_req("r1", [1, 2, 3, 4, 5]))  # blocks 0, 1 full and cached; 2 partial
    assert kv.take_stores() == []  # nothing evicted yet
    compute(kv, make_req("r2", [9] * 8))  # takes 3, 2, 1, 0: evicts 1 then 0
    assert kv.take_stores() == [(1, 0), (0, 1)]  # (device, host), in eviction order
    assert kv.num_stored_blocks == 2
    kv.check_integrity()

    r3 = make_req("r3", [1, 2, 3, 4, 6, 7])
    assert kv.get_computed_blocks(r3) == ([], 0)  # gone from the device ...
    host = kv.get_host_blocks(r3, 0)
    assert [b.block_id for b in host] == [1, 0]  # ... found in the host tier, in prefix order
    new_ids = kv.allocate_slots(r3, r3.num_tokens)
    assert new_ids == [0, 1, 2]
    assert kv.load(host, new_ids) == [(1, 0), (0, 1)]  # (host, device): the prefix blocks
    assert kv.take_stores() == [(0, 2), (1, 3), (2, 4)]  # r2's blocks r3 evicted
    assert kv.cpu_pool.num_free_blocks == 6  # 0 and 1 held while the step's copies read them
    kv.check_integrity()
    kv.release_reads()
    assert kv.cpu_pool.num_free_blocks == 8 and len(kv.cpu_pool.cached) == 5  # still tiered
    r3.num_computed_tokens = r3.num_tokens
    kv.forget(r3)
    compute(kv, make_req("r4", [8] * 8))  # evicts 3 (r2's), 2 (r3's third), then 1 and 0:
    assert kv.take_stores() == [(3, 5), (2, 6)]  # 1 and 0 hold hashes the tier has already
    kv.check_integrity()
    assert kv.all_free()


def test_a_host_block_is_never_served_under_another_salt():
    kv = tiered()
    compute(kv, make_req("r1", [1, 2, 3, 4, 5], salt="x"))
    compute(kv, make_req("r2", [9] * 8, salt="x"))
    assert len(kv.take_stores()) == 2
    assert kv.get_host_blocks(make_req("y", [1, 2, 3, 4, 5], salt="y"), 0) == []
    assert kv.get_host_blocks(make_req("x", [1, 2, 3, 4, 5], salt="x"), 0) != []


def test_lookup_continues_from_the_device_hits_into_the_tier():
    kv = tiered(num_gpu=5)
    compute(kv, make_req("r1", [1, 2, 3, 4, 5, 6, 7]))  # blocks 0, 1, 2 cached; free: 4 3 2 1 0
    compute(kv, make_req("r2", [9] * 6))  # takes 4 and 3, then 2 (r1's third block)
    assert kv.take_stores() == [(2, 0)]
    r3 = make_req("r3", [1, 2, 3, 4, 5, 6, 7, 8])
    hits, n = kv.get_computed_blocks(r3)
    assert [b.block_id for b in hits] == [0, 1] and n == 4
    assert [b.block_id for b in kv.get_host_blocks(r3, len(hits))] == [0]


def test_swap_takes_tier_blocks_least_recently_used_first_and_never_loses_its_own():
    kv = tiered(num_gpu=6, num_cpu=4)
    compute(kv, make_req("r1", list(range(1, 9))))  # 4 full blocks: 0..3
    compute(kv, make_req("r2", [9] * 12))  # evicts 3, 2, 1, 0 (tail first)
    assert kv.take_stores() == [(3, 0), (2, 1), (1, 2), (0, 3)]
    assert kv.cpu_pool.num_free_blocks == 4  # all four tier blocks are evictable
    victim = make_req("v", [7] * 5)
    kv.allocate_slots(victim, 5)
    victim.num_computed_tokens = 5
    assert kv.can_swap_out(victim)
    assert kv.swap_out(victim) == [(0, 0), (1, 1), (2, 2)]  # the LRU tier blocks go first
    assert len(kv.cpu_pool.cached) == 1  # the first prefix block (stored last) is kept
    kv.check_integrity()
    # with every host block swapped or held, an eviction is dropped, not stored over swap
    other = make_req("o", [7] * 2)
    kv.allocate_slots(other, 2)
    other.num_computed_tokens = 2
    kv.swap_out(other)
    kv.take_stores()
    compute(kv, make_req("r3", [5] * 12))
    assert kv.take_stores() == []
    assert kv.export_swapped(victim) == [0, 1, 2]
    kv.check_integrity()


def test_a_swap_in_source_is_held_until_the_next_step():
    kv = tiered(num_gpu=4, num_cpu=3)
    r = make_req("r", [1, 2, 3])
    kv.allocate_slots(r, 3)
    r.num_computed_tokens = 3
    assert kv.swap_out(r) == [(0, 0), (1, 1)]
    kv.swap_in(r)
    # blocks 0 and 1 are read by this step's swap-in copy: a store of this step must not get them
    assert kv.cpu_pool.num_free_blocks == 1
    kv.check_integrity()
    kv.release_reads()
    assert kv.cpu_pool.num_free_blocks == 3
    kv.check_integrity()


@pytest.mark.parametrize("shares", [True, False])
def test_tier_eviction_is_lru_within_tenant_shares(shares):
    kv = tiered(num_gpu=8, num_cpu=4)
    if shares:
        kv.set_kv_shares({"a": 0.5, "b": 0.5})  # 2 host blocks kept for each
    compute(kv, make_req("b1", [1, 2, 3, 4], tenant="b"))
    compute(kv, make_req("a1", [5, 6, 7, 8, 9, 10, 11, 12], tenant="a"))
    compute(kv, make_req("x", [0] * 16, tenant="a"))  # evicts all six cached device blocks
    assert len(kv.take_stores()) == 6  # b's two first, then a's four
    owners = sorted(b.owner for b in kv.cpu_pool.cached.values())
    b_hits = kv.get_host_blocks(make_req("b2", [1, 2, 3, 4, 0], tenant="b"), 0)
    if shares:  # a's last two stores took a's own oldest blocks: b keeps its share
        assert owners == ["a", "a", "b", "b"] and len(b_hits) == 2
    else:  # plain LRU: a's history flushed b's
        assert owners == ["a", "a", "a", "a"] and b_hits == []
    kv.check_integrity()


def test_integrity_catches_a_held_read_that_was_freed():
    kv = tiered()
    compute(kv, make_req("r1", [1, 2, 3, 4, 5]))
    compute(kv, make_req("r2", [9] * 8))
    kv.take_stores()
    r3 = make_req("r3", [1, 2, 3, 4, 6])
    host = kv.get_host_blocks(r3, 0)
    kv.load(host, kv.allocate_slots(r3, 5))
    kv.check_integrity()
    kv.cpu_pool.free(host[:1])  # a bug: the read's hold given back before the step's copies
    with pytest.raises(AssertionError, match="host"):
        kv.check_integrity()


def test_the_scheduler_loads_this_step_and_computes_from_the_next():
    kv = KVCacheManager(4, block_size=2, num_cpu_blocks=8, host_tier=True)
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=8)
    sched = Scheduler(cfg, kv, make_policy("fcfs", [TenantSpec("a")]))

    def run(r: Request) -> list:
        sched.add_request(r)
        outs = []
        while r.request_id in sched.requests:
            out = sched.schedule()
            outs.append(out)
            sampled = {q.request_id: 7 for q in out.scheduled}
            sched.update_from_output(out, RunnerOutput(sampled_token_ids=sampled))
            sched.check_integrity()
        return outs

    r1 = make_req("r1", [1, 2, 3, 4, 5])
    r1.max_num_tokens = 6
    run(r1)
    r2 = make_req("r2", [9, 9, 9, 9, 9, 9, 9])  # needs all 4 blocks: evicts r1's 2
    run(r2)
    r3 = make_req("r3", [1, 2, 3, 4, 5])
    outs = run(r3)
    first, second = outs[0], outs[1]
    assert first.kv_load == [(2, 0), (1, 1)] and first.loading == ["r3"]
    assert first.scheduled == []  # loads now, computes next step
    assert second.num_scheduled_tokens == {"r3": 1}  # only the token after the prefix
    assert sched.num_host_hit_tokens == 4 and r3.num_cached_tokens == 4
    assert kv.all_free()
