"""Preemption: which running requests may give way, and how a victim leaves the GPU.

The policy picks the victim (`Policy.pick_victim`) among the candidates these functions allow;
the scheduler then swaps it out (its K/V copied to CPU blocks, resumed by swap-in) or drops
it for recompute (its blocks freed, its prompt and output computed again on readmission).
"""

from __future__ import annotations

from fairbatch.kv.manager import KVCacheManager
from fairbatch.scheduler.config import SchedulerConfig
from fairbatch.scheduler.request import Request


def takeable(
    kv: KVCacheManager, running: list[Request], candidates: list[Request], request: Request
) -> list[Request]:
    """The `candidates` (running requests) that may give way to `request`: with KV shares,
    another tenant's request only if its tenant keeps at least its reserved blocks without it
    (distinct GPU blocks of its `running` requests). `request` itself always may."""
    if not kv.gpu_pool.reserves:
        return candidates
    held: dict[str, set[int]] = {}
    for r in running:
        held.setdefault(r.tenant, set()).update(kv.block_ids(r.request_id))
    out = []
    for r in candidates:
        if r.tenant != request.tenant and kv.reserve(r.tenant):
            rest = held[r.tenant].difference(kv.block_ids(r.request_id))
            if len(rest) < kv.reserve(r.tenant):
                continue
        out.append(r)
    return out


def preemption_mode(config: SchedulerConfig, kv: KVCacheManager, victim: Request) -> str:
    """ "swap" or "recompute": as configured, or ("auto") whichever the cost model finds
    cheaper - moving the victim's K/V out and back over the host link, or computing its
    tokens again. Recompute whenever the CPU swap space cannot hold it."""
    if config.preemption_mode == "recompute" or not kv.can_swap_out(victim):
        return "recompute"
    if config.preemption_mode == "swap":
        return "swap"
    num_blocks = len(kv.block_ids(victim.request_id))
    swap_bytes = 2 * num_blocks * kv.block_size * config.kv_bytes_per_token
    swap_s = swap_bytes / config.swap_bandwidth
    recompute_s = victim.num_computed_tokens / config.prefill_tokens_per_s
    return "swap" if swap_s < recompute_s else "recompute"
