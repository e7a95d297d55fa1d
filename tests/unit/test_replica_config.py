"""A replica's config reaches the engine it builds (`build_core`): the host KV tier."""

from __future__ import annotations

import pytest

from fairbatch.deployments.cluster.replica_config import ReplicaConfig, build_core
from fairbatch.engine import gpu_profiles


def test_a_replica_gets_the_host_tier_its_config_asks_for():
    shape = gpu_profiles.llama3_8b()  # the sim's default modelled GPU
    tier_blocks = (2**30 // 64) // (shape.kv_bytes_per_token * 16)
    kv = build_core(ReplicaConfig("sim", num_cpu_blocks=4, cpu_cache_gb=1 / 64)).scheduler.kv
    assert kv.host_tier and kv.num_cpu_blocks == 4 + tier_blocks
    kv = build_core(ReplicaConfig("sim", num_cpu_blocks=4)).scheduler.kv
    assert not kv.host_tier and kv.num_cpu_blocks == 4
    tiny = build_core(ReplicaConfig("tiny", device="cpu", cpu_cache_gb=0.01)).scheduler.kv
    assert tiny.host_tier and tiny.num_cpu_blocks > ReplicaConfig.num_cpu_blocks
    assert not build_core(ReplicaConfig("tiny", device="cpu")).scheduler.kv.host_tier


def test_a_negative_host_tier_is_refused_where_the_config_is_read():
    with pytest.raises(ValueError, match="cpu_cache_gb must be >= 0"):
        ReplicaConfig("sim", cpu_cache_gb=-1.0)
