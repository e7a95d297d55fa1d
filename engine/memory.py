"""How big the KV pool may be: the arithmetic (pure), and the profiling run that feeds it.

On CUDA, `build_engine` loads the weights, runs one dummy step of `max_num_batched_tokens`
tokens (and the sampler over `max_num_seqs` rows) and reads the allocator's peak. When decode
steps will replay CUDA graphs it then captures them once over a scratch cache and frees them,
measuring what they add to the device (their memory pool, static inputs and the pad block):
the real graphs are captured after the KV pool exists (they read it at fixed addresses), so
their memory must be set aside before the pool is sized. Newer vLLM releases likewise
estimate CUDA-graph memory during memory profiling; older ones captured after sizing and
left the graphs to the (1 - gpu_memory_utilization) headroom. The pool then gets what is
left of our share of the device:

    budget = utilization x total - weights - peak activations - CUDA graphs
             - memory other processes hold

`total - free` would count the other processes' memory as ours and undersize (or oversize) the
pool. A pool is also never larger than `max_num_seqs` sequences of `max_model_len` tokens need,
so a small model on a large GPU does not build millions of Python block objects.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

# The host tier's size on CUDA when not given (GiB), at most a quarter of the free host memory.
DEFAULT_CPU_CACHE_GB = 4.0


@dataclass(frozen=True)
class MemoryProfile:
    """Bytes on one device, as measured before the KV cache exists."""

    total: int  # the device's memory
    weights: int  # our weights (allocated after loading, before the dummy step)
    peak_activations: int  # peak allocated during the dummy step, above the weights
    others: int  # held outside our allocator: other processes (and our CUDA context)
    cuda_graphs: int = 0  # what capturing the decode graphs adds (0: eager)


def kv_cache_budget(profile: MemoryProfile, utilization: float) -> int:
    """Bytes the KV cache may take: our share of the device less everything else on it."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    used = profile.weights + profile.peak_activations + profile.cuda_graphs + profile.others
    return max(int(profile.total * utilization) - used, 0)


def max_useful_blocks(max_model_len: int, max_num_seqs: int, block_size: int) -> int:
    """Blocks that `max_num_seqs` sequences of `max_model_len` tokens can fill at once."""
    return -(-max_model_len // block_size) * max_num_seqs


def num_kv_blocks(budget_bytes: int, bytes_per_block: int, cap: int | None = None) -> int:
    """Whole blocks that fit in `budget_bytes`, at most `cap`."""
    blocks = max(int(budget_bytes // bytes_per_block), 0)
    return blocks if cap is None else min(blocks, cap)


def host_memory_available() -> int:
    """Bytes of host memory free for new allocations (the kernel's MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_cpu_cache_gb(is_cuda: bool, available: int) -> float:
    """The host tier's size when not configured: none on a CPU-only engine (its "device" pool
    is host memory already), else DEFAULT_CPU_CACHE_GB, at most a quarter of `available`."""
    return min(DEFAULT_CPU_CACHE_GB, available / 4 / 2**30) if is_cuda else 0.0


def check_host_kv_memory(tier_bytes: int, swap_bytes: int, available: int) -> None:
    """Refuse host KV memory (prefix tier + swap space) that the machine does not have free."""
    if tier_bytes + swap_bytes > available:
        raise ValueError(
            f"host KV memory of {(tier_bytes + swap_bytes) / 2**30:.2f} GiB (cpu_cache_gb "
            f"{tier_bytes / 2**30:.2f} GiB + swap space {swap_bytes / 2**30:.2f} GiB) exceeds "
            f"the {available / 2**30:.2f} GiB of free host memory; lower cpu_cache_gb"
        )


def dummy_step(
    max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int
) -> tuple[list[int], list[list[int]]]:
    """The largest step the scheduler can make, as (query lengths, block tables): prompts as
    long as a sequence may be, `max_num_batched_tokens` tokens in all, at most `max_num_seqs`
    of them. Long prompts are the worst case for attention's scratch memory. Block ids start
    at 0 and do not overlap."""
    lens: list[int] = []
    left = max_num_batched_tokens
    while left > 0 and len(lens) < max_num_seqs:
        lens.append(min(left, max_model_len))
        left -= lens[-1]
    tables, next_block = [], 0
    for n in lens:
        count = -(-n // block_size)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    return lens, tables


@torch.inference_mode()
def run_dummy_step(
    model,
    kv_caches: list[torch.Tensor],
    query_lens: list[int],
    tables: list[list[int]],
    block_size: int,
    num_sample_rows: int,
    sampler=None,
) -> None:
    """One forward over the given prompts into `kv_caches`, then the logits of
    `num_sample_rows` rows and, with a sampler, one random-sampling pass over them."""
    from fairbatch.engine.attention import AttentionMetadata
    from fairbatch.engine.sampling_params import SamplingParams

    device = kv_caches[0].device
    meta, positions = AttentionMetadata.build(query_lens, query_lens, tables, block_size, device)
    ids = torch.zeros(sum(query_lens), dtype=torch.long, device=device)
    hidden = model(ids, positions, kv_caches, meta)
    rows = torch.arange(num_sample_rows, device=device) % hidden.shape[0]
    logits = model.compute_logits(hidden.index_select(0, rows))
    if sampler is not None:
        params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50)] * num_sample_rows
        sampler.sample(logits, params, [[0]] * num_sample_rows, [[]] * num_sample_rows)


def profile_cuda_memory(
    model,
    layout,
    device: torch.device,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    sampler=None,
    cuda_graphs: bool = False,
) -> MemoryProfile:
    """Measure weights and peak activations with one dummy step (CUDA only), and with
    `cuda_graphs` the decode graphs' memory. The step writes its K/V into a scratch cache just
    big enough for it; that cache is not counted."""
    from fairbatch.kv.cache_engine import CacheEngine

    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(device)
    lens, tables = dummy_step(
        max_num_batched_tokens, max_num_seqs, max_model_len, layout.block_size
    )
    scratch = CacheEngine(layout, sum(len(t) for t in tables), 0, device)
    scratch_bytes = torch.cuda.memory_allocated(device) - weights
    torch.cuda.reset_peak_memory_stats(device)
    run_dummy_step(
        model, scratch.layer_caches(), lens, tables, layout.block_size, max_num_seqs, sampler
    )
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - weights - scratch_bytes
    del scratch
    torch.cuda.empty_cache()
    graphs = (
        measure_graph_memory(model, layout, device, max_num_seqs, max_model_len)
        if cuda_graphs
        else 0
    )
    free, total = torch.cuda.mem_get_info(device)
    others = max(total - free - torch.cuda.memory_reserved(device), 0)
    return MemoryProfile(total, weights, max(peak, 0), others, graphs)


def measure_graph_memory(
    model, layout, device: torch.device, max_num_seqs: int, max_model_len: int
) -> int:
    """Device bytes the decode CUDA graphs add, measured as the drop in free device memory
    while they exist: captured once over a cache of just the pad block (capture writes
    nothing else, and a graph's memory does not depend on the pool's size: the cache is an
    input), then freed. The pad block, the static inputs and the graph pools all count, and
    so does the driver's share, which the allocator's own counters do not see."""
    from fairbatch.engine.cuda_graphs import DecodeGraphs
    from fairbatch.kv.cache_engine import CacheEngine

    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info(device)[0]
    scratch = CacheEngine(layout, 0, 0, device, pad_block=True)
    graphs = DecodeGraphs(
        model, scratch.layer_caches(), layout.block_size, max_num_seqs, max_model_len,
        scratch.pad_block,
    )  # fmt: skip
    graphs.capture()
    # The eager warm-up's freed blocks are cached, not held: the pool may reuse them.
    torch.cuda.empty_cache()
    free_after = torch.cuda.mem_get_info(device)[0]
    del graphs, scratch
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return max(free_before - free_after, 0)
