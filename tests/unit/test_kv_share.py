"""Per-tenant KV shares: eviction order in the pool and preemption victims, with exact block ids."""

from __future__ import annotations

import pytest

from fairbatch.kv.block_pool import BlockPool
from fairbatch.kv.manager import KVCacheManager
from fairbatch.policies import TenantSpec, make_policy
from fairbatch.scheduler import Request, Scheduler, SchedulerConfig
from fairbatch.scheduler.fake_runner import FakeRunner


def cache_and_free(pool: BlockPool, owner: str, n: int, tag: bytes) -> list[int]:
    blocks = pool.allocate(n, owner)
    for i, b in enumerate(blocks):
        pool.cache(b, tag + bytes([i]), [i])
    pool.free(blocks)
    return [b.block_id for b in blocks]


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_eviction_takes_from_tenants_over_their_share_first():
    pool = BlockPool(6, 1)
    pool.set_reserves({"a": 2})
    assert cache_and_free(pool, "a", 3, b"a") == [0, 1, 2]  # a holds 3 cached blocks, keeps 2
    assert cache_and_free(pool, "b", 2, b"b") == [3, 4]  # b has no share
    assert pool.held == {"a": 3, "b": 2}
    # LRU order is 5, 0, 1, 2, 3, 4; a is over its share by one block: 0 goes, 1 and 2 stay
    assert ids(pool.allocate(4, "c")) == [5, 0, 3, 4]
    assert pool.lookup(b"a\x01", [1]) is not None and pool.lookup(b"a\x02", [2]) is not None
    assert pool.held == {"a": 2, "b": 0, "c": 4}
    pool.check_integrity()
    # nothing else is left: a's kept blocks go last, in LRU order
    assert ids(pool.allocate(2, "c")) == [1, 2]
    assert pool.held == {"a": 0, "b": 0, "c": 6}
    pool.check_integrity()


def test_without_shares_eviction_is_plain_lru():
    pool = BlockPool(6, 1)
    cache_and_free(pool, "a", 3, b"a")
    cache_and_free(pool, "b", 2, b"b")
    assert ids(pool.allocate(4, "c")) == [5, 0, 1, 2]
    pool.check_integrity()


def test_a_block_freed_uncached_or_reset_leaves_its_owner():
    pool = BlockPool(4, 1)
    pool.set_reserves({"a": 1})
    blocks = pool.allocate(2, "a")
    pool.cache(blocks[0], b"x", [0])
    pool.free(blocks)  # block 1 is plain free now, block 0 cached
    assert pool.held == {"a": 1}
    pool.reset_cache()
    assert pool.held == {"a": 0}
    pool.check_integrity()


def run_three(share: float | None) -> list[tuple[dict, list]]:
    """B1 (b), A1 (a), B2 (b) fill 11 blocks of 4; each then needs one more, none is free."""
    kv = KVCacheManager(11, 4)
    specs = [TenantSpec("a", kv_share=share), TenantSpec("b")]
    cfg = SchedulerConfig(max_model_len=64, max_num_batched_tokens=256, preemption_mode="recompute")
    sched = Scheduler(cfg, kv, make_policy("weighted_fair", specs))
    runner = FakeRunner(1000)
    sched.add_request(Request("B1", list(range(100, 112)), max_tokens=8, tenant="b"))
    sched.add_request(Request("A1", list(range(200, 224)), max_tokens=8, tenant="a"))
    sched.add_request(Request("B2", list(range(300, 308)), max_tokens=8, tenant="b"))
    steps = []
    for _ in range(2):
        out = sched.schedule()
        tables = {r.request_id: list(kv.block_ids(r.request_id)) for r in sched.running}
        steps.append((tables, list(out.preempted_recompute)))
        sched.update_from_output(out, runner.execute(out))
    kv.check_integrity()
    return steps


def test_a_tenant_within_its_share_is_no_victim_of_another_tenant():
    first = {"B1": [0, 1, 2], "A1": [3, 4, 5, 6, 7, 8], "B2": [9, 10]}
    # no shares: B1 is short of a block and a (the higher counter: 26 vs 24) gives way
    assert run_three(None) == [
        (first, []),
        ({"B1": [0, 1, 2, 8], "B2": [9, 10, 7]}, ["A1"]),
    ]
    # a keeps int(0.5 x 11) = 5 blocks: its 6 are all it has, so b's own B2 gives way
    assert run_three(0.5) == [
        (first, []),
        ({"B1": [0, 1, 2, 10], "A1": [3, 4, 5, 6, 7, 8, 9]}, ["B2"]),
    ]
    # a share a keeps without A1 (int(0.05 x 11) = 0 blocks) protects nothing
    assert run_three(0.05)[1][1] == ["A1"]


def test_priority_preemption_spares_a_tenant_within_its_share():
    def admitted(share):
        kv = KVCacheManager(8, 4)
        specs = [TenantSpec("a", kv_share=share), TenantSpec("b")]
        cfg = SchedulerConfig(
            max_model_len=64, max_num_batched_tokens=256, preemption_mode="recompute"
        )
        sched = Scheduler(cfg, kv, make_policy("priority", specs))
        runner = FakeRunner(1000)
        sched.add_request(Request("A", list(range(200, 224)), max_tokens=8, tenant="a"))
        sched.update_from_output(out := sched.schedule(), runner.execute(out))
        sched.add_request(Request("V", list(range(100, 112)), max_tokens=8, tenant="b", priority=5))
        out = sched.schedule()
        return [r.request_id for r in out.scheduled], out.preempted_recompute

    assert admitted(None) == (["V"], ["A"])  # V needs 3 blocks, 1 is free: A gives way
    assert admitted(0.75) == (["A"], [])  # a keeps 6 blocks: V waits


@pytest.mark.parametrize("share", [0.0, -0.1, 1.5, "half"])
def test_kv_share_is_checked(share):
    with pytest.raises(ValueError):
        TenantSpec("a", kv_share=share)


def test_shares_must_sum_to_at_most_one():
    kv = KVCacheManager(10, 4)
    with pytest.raises(ValueError, match="sum"):
        kv.set_kv_shares({"a": 0.6, "b": 0.5})
    specs = [TenantSpec("a", kv_share=0.6), TenantSpec("b", kv_share=0.5)]
    with pytest.raises(ValueError, match="sum"):
        Scheduler(SchedulerConfig(max_model_len=40), kv, make_policy("fcfs", specs))
    kv.set_kv_shares({"a": 0.6, "b": 0.4})
    assert (kv.reserve("a"), kv.reserve("b"), kv.reserve("c")) == (6, 4, 0)


def test_app_config_and_llm_take_kv_shares_and_policy_kwargs():
    from fairbatch.deployments.api.config import ConfigError
    from fairbatch.deployments.serve.app import parse_app_args
    from fairbatch.engine.llm import LLM

    cfg = parse_app_args(
        {
            "model": "sim",
            "tenants": [{"name": "a", "kv_share": 0.5}, {"name": "b", "weight": 2}],
            "engine": {"policy": "dlpm", "policy_kwargs": {"quantum": 1024}},
            "controller": {"routing": "d2lpm", "policy": "dlpm"},
        }
    )
    assert [(t.name, t.kv_share) for t in cfg.replica_config().tenants] == [("a", 0.5)]
    assert cfg.controller_config().routing == "d2lpm"
    bad = [
        {"tenants": [{"name": "a", "kv_share": 0.7}, {"name": "b", "kv_share": 0.5}]},
        {"tenants": [{"name": "a", "kv_share": 1.5}]},
        {"engine": {"policy": "dlpm", "policy_kwargs": {"quantum": -1}}},
        {"controller": {"policy": "dlpm", "policy_kwargs": {"nope": 1}}},
    ]
    for args in bad:
        with pytest.raises(ConfigError):
            parse_app_args({"model": "sim", **args})
    llm = LLM(
        "tiny",
        policy="dlpm",
        policy_kwargs={"quantum": 512},
        tenants=[TenantSpec("a", kv_share=0.5)],
        num_gpu_blocks=64,
    )
    assert llm.engine.scheduler.kv.reserve("a") == 32
    assert llm.engine.scheduler.policy.quantum == 512.0
