"""Block pool and KV manager: exact block ids, free-list order, prefix hits, eviction, swap."""

import subprocess
import sys

import pytest

from fairbatch.kv import BlockPool, KVCacheManager, hash_block
from fairbatch.scheduler.request import Request


def free_order(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


def make_req(rid: str, tokens: list[int], tenant: str = "a", salt: str | None = None) -> Request:
    return Request(rid, tokens, max_tokens=8, tenant=tenant, cache_salt=salt)


def test_allocate_free_exact_ids_and_lru_order():
    pool = BlockPool(6, 4)
    a = pool.allocate(2)
    b = pool.allocate(3)
    assert [x.block_id for x in a] == [0, 1]
    assert [x.block_id for x in b] == [2, 3, 4]
    assert free_order(pool) == [5]
    pool.free(reversed(b))  # tail first: block 4 is the first to be reused
    assert free_order(pool) == [5, 4, 3, 2]
    pool.free(a)
    assert free_order(pool) == [5, 4, 3, 2, 0, 1]
    assert [x.block_id for x in pool.allocate(3)] == [5, 4, 3]
    pool.check_integrity()


def test_allocate_too_many_raises_and_changes_nothing():
    pool = BlockPool(3, 4)
    pool.allocate(2)
    with pytest.raises(ValueError, match="only 1 free"):
        pool.allocate(2)
    assert free_order(pool) == [2]
    pool.check_integrity()


def test_double_free_is_caught():
    pool = BlockPool(2, 4)
    (blk,) = pool.allocate(1)
    pool.free([blk])
    with pytest.raises(AssertionError):
        pool.free([blk])


def test_cached_block_leaves_middle_of_free_list():
    pool = BlockPool(4, 2)
    blocks = pool.allocate(4)
    h = hash_block(None, [7, 8], "a")
    pool.cache(blocks[2], h, [7, 8])
    pool.free(blocks)
    assert free_order(pool) == [0, 1, 2, 3]
    hit = pool.lookup(h, [7, 8])
    assert hit is blocks[2]
    pool.touch([hit])
    assert free_order(pool) == [0, 1, 3]
    assert hit.ref_cnt == 1
    pool.check_integrity()
    assert pool.counts() == (3, 0, 1)


def test_hash_is_chained_salted_and_stable_across_processes():
    h1 = hash_block(None, [1, 2, 3], "t1")
    assert h1 != hash_block(None, [1, 2, 3], "t2")
    assert h1 != hash_block(None, [1, 2, 3], None)
    assert hash_block(h1, [4, 5, 6], "t1") != hash_block(None, [4, 5, 6], "t1")
    code = "from fairbatch.kv import hash_block;print(hash_block(None, [1, 2, 3], 't1').hex())"
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert other == h1.hex()


def test_lookup_checks_stored_tokens():
    pool = BlockPool(2, 2)
    (blk,) = pool.allocate(1)
    h = hash_block(None, [1, 2], None)
    pool.cache(blk, h, [1, 2])
    assert pool.lookup(h, [1, 2]) is blk
    assert pool.lookup(h, [1, 3]) is None  # a forged/colliding hash never hands out K/V


def test_prefix_hit_then_eviction_in_lru_order():
    kv = KVCacheManager(num_gpu_blocks=6, block_size=4)
    r1 = make_req("r1", list(range(10)))  # 2 full blocks + 2 tokens
    assert kv.get_computed_blocks(r1) == ([], 0)
    assert kv.allocate_slots(r1, 10) == [0, 1, 2]
    r1.num_computed_tokens = 10
    kv.cache_computed_blocks(r1)
    assert len(kv.gpu_pool.cached) == 2  # the partial block is never cached
    kv.free(r1)
    # Tail first: 2 (partial), then 1, then 0; never-used 3,4,5 come before them.
    assert free_order(kv.gpu_pool) == [3, 4, 5, 2, 1, 0]
    kv.check_integrity()

    r2 = make_req("r2", list(range(8)) + [99, 98, 97])
    hits, n = kv.get_computed_blocks(r2)
    assert [b.block_id for b in hits] == [0, 1] and n == 8
    assert kv.allocate_slots(r2, 3, hits) == [3]
    assert kv.block_ids("r2") == [0, 1, 3]
    assert free_order(kv.gpu_pool) == [4, 5, 2]
    kv.check_integrity()

    # Different tenant, same tokens: no sharing.
    r3 = make_req("r3", list(range(10)), tenant="b")
    assert kv.get_computed_blocks(r3) == ([], 0)
    # Same sharing group: shares.
    r4 = make_req("r4", list(range(10)), tenant="b", salt="a")
    assert [b.block_id for b in kv.get_computed_blocks(r4)[0]] == [0, 1]


def test_full_prompt_hit_leaves_one_token_to_compute():
    kv = KVCacheManager(num_gpu_blocks=4, block_size=4)
    r1 = make_req("r1", list(range(8)))
    kv.allocate_slots(r1, 8)
    r1.num_computed_tokens = 8
    kv.cache_computed_blocks(r1)
    r2 = make_req("r2", list(range(8)))
    hits, n = kv.get_computed_blocks(r2)
    assert [b.block_id for b in hits] == [0] and n == 4  # block 1 would leave nothing to compute


def test_eviction_of_cached_block_removes_hash():
    kv = KVCacheManager(num_gpu_blocks=2, block_size=2)
    r1 = make_req("r1", [1, 2, 3, 4])
    kv.allocate_slots(r1, 4)
    r1.num_computed_tokens = 4
    kv.cache_computed_blocks(r1)
    kv.free(r1)
    assert free_order(kv.gpu_pool) == [1, 0]
    r2 = make_req("r2", [5, 6, 7])
    assert kv.allocate_slots(r2, 3) == [1, 0]  # evicts both cached blocks
    assert kv.gpu_pool.cached == {}
    r3 = make_req("r3", [1, 2, 3, 4, 5])
    assert kv.get_computed_blocks(r3) == ([], 0)
    kv.check_integrity()


def test_allocate_slots_counts_evictable_hits_against_free_blocks():
    kv = KVCacheManager(num_gpu_blocks=3, block_size=2)
    r1 = make_req("r1", [1, 2, 3, 4])
    kv.allocate_slots(r1, 4)
    r1.num_computed_tokens = 4
    kv.cache_computed_blocks(r1)
    kv.free(r1)
    r2 = make_req("r2", [1, 2, 3, 4, 5, 6, 7])
    hits, n = kv.get_computed_blocks(r2)
    assert n == 4
    # needs 4 blocks: 2 hits (both on the free list) + 2 new, only 3 exist -> None, no change
    assert kv.allocate_slots(r2, 3, hits) is None
    assert kv.gpu_pool.num_free_blocks == 3
    kv.check_integrity()


def test_decode_growth_allocates_only_at_block_boundary():
    kv = KVCacheManager(num_gpu_blocks=4, block_size=4)
    r = make_req("r", [1, 2, 3])
    assert kv.allocate_slots(r, 3) == [0]
    r.num_computed_tokens = 3
    r.append_output_token(4)
    assert kv.allocate_slots(r, 1) == []
    r.num_computed_tokens = 4
    r.append_output_token(5)
    assert kv.allocate_slots(r, 1) == [1]
    assert kv.block_ids("r") == [0, 1]


def test_swap_out_and_in_exact_maps():
    kv = KVCacheManager(num_gpu_blocks=4, block_size=2, num_cpu_blocks=3)
    r = make_req("r", [1, 2, 3])
    kv.allocate_slots(r, 3)
    r.num_computed_tokens = 3
    kv.cache_computed_blocks(r)
    assert kv.can_swap_out(r)
    assert kv.swap_out(r) == [(0, 0), (1, 1)]
    assert kv.block_ids("r") == []
    assert kv.gpu_pool.num_free_blocks == 4
    assert kv.cpu_pool.num_free_blocks == 1
    kv.check_integrity()
    other = make_req("o", [9, 9, 9, 9, 9])
    assert kv.allocate_slots(other, 5) == [2, 3, 1]  # block 0 stays cached longest (LRU)
    assert not kv.can_swap_in(r)
    kv.free(other)
    assert kv.can_swap_in(r)
    mapping = kv.swap_in(r)
    assert [c for c, _ in mapping] == [0, 1]
    assert kv.block_ids("r") == [g for _, g in mapping]
    assert kv.cpu_pool.num_free_blocks == 3
    kv.check_integrity()
    kv.forget(r)
    assert kv.all_free()


def test_cannot_swap_without_space():
    kv = KVCacheManager(num_gpu_blocks=4, block_size=2, num_cpu_blocks=1)
    r = make_req("r", [1, 2, 3])
    kv.allocate_slots(r, 3)
    assert not kv.can_swap_out(r)
    with pytest.raises(ValueError):
        kv.swap_out(r)
    kv.check_integrity()


def test_export_import_swapped():
    kv = KVCacheManager(num_gpu_blocks=4, block_size=2, num_cpu_blocks=4)
    r = make_req("r", [1, 2, 3])
    kv.allocate_slots(r, 3)
    kv.swap_out(r)
    assert kv.export_swapped(r) == [0, 1]
    kv.forget(r)
    assert kv.all_free()
    r2 = make_req("r2", [1, 2, 3])
    assert kv.import_swapped(r2, 2) == [2, 3]
    assert kv.import_swapped(make_req("r3", [1]), 3) is None
    kv.check_integrity()


def test_a_block_shared_by_two_live_requests_is_freed_by_the_last_one():
    kv = KVCacheManager(num_gpu_blocks=6, block_size=4)
    r1 = make_req("r1", list(range(10)))  # blocks 0, 1 full; 2 partial
    assert kv.allocate_slots(r1, 10) == [0, 1, 2]
    r1.num_computed_tokens = 10
    kv.cache_computed_blocks(r1)
    r2 = make_req("r2", list(range(8)) + [50, 51])  # same two full blocks, own tail
    hits, n = kv.get_computed_blocks(r2)
    assert [b.block_id for b in hits] == [0, 1] and n == 8
    assert kv.allocate_slots(r2, 2, hits) == [3]
    pool = kv.gpu_pool
    assert [pool.blocks[i].ref_cnt for i in range(6)] == [2, 2, 1, 1, 0, 0]
    kv.check_integrity()

    kv.free(r1)  # the shared blocks stay with r2: only r1's own tail is released
    assert [pool.blocks[i].ref_cnt for i in range(6)] == [1, 1, 0, 1, 0, 0]
    assert free_order(pool) == [4, 5, 2]
    assert kv.block_ids("r2") == [0, 1, 3]
    kv.check_integrity()

    kv.free(r2)  # now they are free, tail first, and still cached
    assert free_order(pool) == [4, 5, 2, 3, 1, 0]
    assert pool.counts() == (4, 2, 0)
    assert [b.block_id for b in kv.get_computed_blocks(make_req("r3", list(range(9))))[0]] == [
        0,
        1,
    ]
    kv.check_integrity()


def test_pool_integrity_catches_a_lost_or_doubly_held_block():
    pool = BlockPool(4, 2)
    (blk,) = pool.allocate(1)
    blk.ref_cnt = 0  # a free that forgot the free list: unreferenced, on no list
    with pytest.raises(AssertionError, match="unreferenced but not free"):
        pool.check_integrity()

    pool = BlockPool(4, 2)
    free_blk = pool.blocks[3]
    free_blk.ref_cnt = 1  # referenced while still on the free list
    with pytest.raises(AssertionError, match="referenced and on the list"):
        pool.check_integrity()

    pool = BlockPool(4, 2)
    pool.free_queue.num_free += 1  # the count drifts from the list
    with pytest.raises(AssertionError, match="free count"):
        pool.check_integrity()


def test_manager_integrity_checks_the_swap_pool_too():
    kv = KVCacheManager(num_gpu_blocks=4, block_size=2, num_cpu_blocks=4)
    r = make_req("r", [1, 2, 3])
    kv.allocate_slots(r, 3)
    r.num_computed_tokens = 3
    kv.swap_out(r)
    kv.check_integrity()
    kv.cpu_pool.blocks[0].ref_cnt = 0  # the swap pool loses a block its request still holds
    with pytest.raises(AssertionError):
        kv.check_integrity()


def test_integrity_catches_leak():
    kv = KVCacheManager(num_gpu_blocks=4, block_size=2)
    r = make_req("r", [1, 2, 3])
    kv.allocate_slots(r, 3)
    kv.req_blocks.pop("r")  # simulate a manager bug: the table forgets its blocks
    with pytest.raises(AssertionError):
        kv.check_integrity()


@pytest.mark.parametrize("intake", [True, False])
@pytest.mark.parametrize("salt", [None, "group"])
def test_registered_hashes_are_the_hash_block_chain(salt, intake):
    """The hashes the cache registers (in runs, by lookup, chunk, decode and free; the prompt's
    hashed at intake or as it goes) are exactly `hash_block` chained block by block: what
    clients compute for prefix affinity."""
    kv = KVCacheManager(num_gpu_blocks=8, block_size=4)
    tokens = [(7 * i) % 23 for i in range(18)]  # 4 full blocks + 2 tokens
    r = make_req("r", tokens[:9], salt=salt)
    if intake:
        kv.hash_prompt(r)  # as Scheduler.add_request does: blocks 0 and 1
        assert len(kv.req_hashes["r"]) == 2
    assert kv.get_computed_blocks(r) == ([], 0)  # a miss (hashes block 0 if not yet)
    kv.allocate_slots(r, 5)
    r.num_computed_tokens = 5
    kv.cache_computed_blocks(r)  # block 0
    kv.allocate_slots(r, 4)
    r.num_computed_tokens = 9
    kv.cache_computed_blocks(r)  # block 1
    for t in tokens[9:]:  # decodes fill blocks 2 and 3, registered by free
        r.all_token_ids.append(t)
        kv.allocate_slots(r, 1)
        r.num_computed_tokens += 1
    kv.free(r)
    chain, parent = [], None
    for i in range(4):
        parent = hash_block(parent, tokens[4 * i : 4 * i + 4], r.cache_salt)
        chain.append(parent)
    assert kv.cached_hashes() == chain
    for i, h in enumerate(chain):  # each block keeps its own tokens, checked on a hit
        assert kv.gpu_pool.lookup(h, tokens[4 * i : 4 * i + 4]) is kv.gpu_pool.cached[h]
        assert kv.gpu_pool.lookup(h, tokens[4 * i + 1 : 4 * i + 5]) is None
    kv.check_integrity()


def test_hash_block_rejects_token_ids_outside_uint32_clearly():
    assert hash_block(None, [0, 2**32 - 1], "s") != hash_block(None, [0, 2**32 - 2], "s")
    for bad in ([-1, 2], [2**32, 2], [1.5, 2]):
        with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 2\*\*32\)"):
            hash_block(None, bad, "s")


def test_the_cluster_client_hashes_a_lora_prompt_as_its_replica_caches_it():
    # The controller routes by the client's prompt hashes against those replicas report: under
    # an adapter both must use the adapter-salted chain, or LoRA requests never find their
    # cached prefixes (and an adapter's never match the base model's).
    from types import SimpleNamespace

    ray = pytest.importorskip("ray")  # noqa: F841 (the client module imports it)
    from fairbatch.deployments.cluster.client import ClusterClient
    from fairbatch.scheduler.request import lora_salt

    tokens = list(range(100, 112))  # 3 full blocks of 4
    kv = KVCacheManager(num_gpu_blocks=8, block_size=4)
    chains = {}
    for lora in (None, "x"):
        r = Request(f"r-{lora}", tokens, max_tokens=8, tenant="t", lora_name=lora)
        kv.allocate_slots(r, len(tokens))
        r.num_computed_tokens = len(tokens)
        kv.cache_computed_blocks(r)
        chains[lora] = list(kv.req_hashes[r.request_id])
        client = SimpleNamespace(block_size=4)
        assert ClusterClient.prefix_hashes(client, tokens, lora_salt("t", lora)) == chains[lora]
    assert len(chains["x"]) == 3 and not set(chains["x"]) & set(chains[None])
