"""Host KV memory at start: a host tier larger than the free memory is refused with the numbers;
memory that cannot be pinned is used pageable, with a warning."""

import pytest
import torch

from fairbatch.engine import LLM
from fairbatch.engine.memory import (
    DEFAULT_CPU_CACHE_GB,
    check_host_kv_memory,
    default_cpu_cache_gb,
    host_memory_available,
)
from fairbatch.kv.cache_engine import host_tensor

GIB = 2**30


def test_more_host_memory_than_is_free_is_refused_with_the_numbers():
    check_host_kv_memory(3 * GIB, 1 * GIB, 4 * GIB)  # fits exactly
    with pytest.raises(ValueError) as e:
        check_host_kv_memory(3 * GIB, 1 * GIB + 1, 4 * GIB)
    assert "4.00 GiB (cpu_cache_gb 3.00 GiB + swap space 1.00 GiB)" in str(e.value)
    assert "the 4.00 GiB of free host memory" in str(e.value)


def test_build_engine_refuses_a_tier_larger_than_the_machine():
    too_big = host_memory_available() / GIB + 1
    with pytest.raises(ValueError, match="exceeds the .* GiB of free host memory"):
        LLM("tiny", num_gpu_blocks=8, cpu_cache_gb=too_big)


def test_the_tier_is_off_on_cpu_and_sized_on_cuda():
    assert default_cpu_cache_gb(False, 64 * GIB) == 0.0
    assert default_cpu_cache_gb(True, 64 * GIB) == DEFAULT_CPU_CACHE_GB
    assert default_cpu_cache_gb(True, 8 * GIB) == 2.0  # a quarter of what is free
    engine = LLM("tiny", num_gpu_blocks=8).engine
    assert not engine.scheduler.kv.host_tier


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning works with CUDA")
def test_memory_that_cannot_be_pinned_is_pageable_with_a_warning():
    with pytest.warns(UserWarning, match="could not be pinned"):
        t = host_tensor((2, 3), torch.float32, pin=True)
    assert t.shape == (2, 3) and not t.any()
