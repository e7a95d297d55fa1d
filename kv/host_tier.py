"""The host half of `KVCacheManager` (which inherits `HostTier`): the prefix cache's host tier.

Host memory holds two things in one pool. Swap: a preempted request's blocks, in use (ref count
> 0), private to it, never evicted. With `host_tier`, the prefix cache's second tier: each
full block the device pool evicts is kept here under the same salted hash (`take_stores`: one
copy per block, none for a hash the tier holds already) and a prefix lookup continues into it
(`get_host_blocks`; `load` copies the hits back to fresh device blocks). Tier blocks are cached
blocks of this pool (ref count 0, on its free list), so a swap-out evicts them, least recently
used first, before it could fail: swap never loses a block to the tier, and the tier only ever
loses cached copies (a later hit recomputes). Tenants' KV shares are the device pool's, in
host blocks: a store takes a free block, or the LRU cached one of its own tenant or of a
tenant over its share, never another tenant's within its share. Host blocks that a step's
copies read (swap-in sources, loaded tier blocks) stay held until the next step
(`release_reads`), so no copy of the same step writes them.
"""

from __future__ import annotations

from fairbatch.kv.block_pool import BlockPool, KVBlock


class HostTier:
    """Needs from the manager: `host_tier`, `gpu_pool`, `cpu_pool`, `num_cpu_blocks`,
    `req_blocks`, `_chain`, `block_size`, `_host_reads`, `num_stored_blocks`,
    `num_loaded_blocks`."""

    gpu_pool: BlockPool
    cpu_pool: BlockPool

    def get_host_blocks(self, request, num_device_hits: int) -> list[KVBlock]:
        """Host-tier blocks continuing the prefix that `get_computed_blocks` found on the device
        (`num_device_hits` blocks), by the same salted hashes and token check; as there, at
        least one token is left to compute. Changes nothing: `load` takes them."""
        if not self.host_tier or request.request_id in self.req_blocks:
            return []
        return self._cached_run(self.cpu_pool, request, num_device_hits)

    def load(self, host_blocks: list[KVBlock], gpu_ids: list[int]) -> list[tuple[int, int]]:
        """(host block, device block) copies loading tier hits into a request's device blocks
        (the first ones `allocate_slots` gave it after its device hits). The host blocks are
        held until the copies are issued (`release_reads`); they stay in the tier after."""
        self.cpu_pool.touch(host_blocks)
        self._host_reads.extend(host_blocks)
        self.num_loaded_blocks += len(host_blocks)
        return [(h.block_id, g) for h, g in zip(host_blocks, gpu_ids)]

    def take_stores(self) -> list[tuple[int, int]]:
        """(device block, host block) copies keeping the blocks the device pool evicted since
        the last call in the host tier, under the same hash and owner: to issue before anything
        writes those device blocks (the runner issues them first). A hash the tier holds is
        not written again, only made most recently used; a block that finds no host block
        (swap holds them all) is dropped, as without the tier."""
        evicted = self.gpu_pool.evicted
        if not evicted:
            return []
        pool, stores = self.cpu_pool, []
        for gpu_id, block_hash, token_bytes, owner in evicted:
            known = pool.cached.get(block_hash)
            if known is not None:
                if not known.ref_cnt:
                    pool.touch([known])
                    pool.free([known])  # (to the free list's tail: evicted last)
                continue
            block = pool.allocate_within_share(owner)
            if block is None:
                continue
            pool.register([block], [block_hash], [token_bytes], 0, 1)
            pool.free([block])
            stores.append((gpu_id, block.block_id))
        evicted.clear()
        self.num_stored_blocks += len(stores)
        return stores

    def _read(self, host_blocks: list[KVBlock]) -> None:
        """Host blocks a swap-in reads, released: with the tier they are held until the next
        step (a tier store of this step could take them otherwise), without it at once."""
        if self.host_tier:
            self._host_reads.extend(host_blocks)  # (with their swap reference, freed then)
        else:
            self.cpu_pool.free(host_blocks)

    def release_reads(self) -> None:
        """The copies of the last step were issued: the host blocks they read are free again
        (tier blocks stay cached). Called at the start of each step."""
        if self._host_reads:
            self.cpu_pool.free(self._host_reads)
            self._host_reads = []

    def host_tier_stats(self) -> dict[str, int]:
        """The tier's occupancy and cumulative block counts (for metrics); zeros without it."""
        on = self.host_tier
        return {
            "cached_blocks": len(self.cpu_pool.cached) if on else 0,
            "capacity_blocks": self.num_cpu_blocks if on else 0,
            "stored_blocks": self.num_stored_blocks,
            "loaded_blocks": self.num_loaded_blocks,
            "evicted_blocks": self.cpu_pool.num_evicted,
        }

    def host_cached_hashes(self) -> list[bytes]:
        """Hashes of the blocks the host tier can serve (reported for prefix affinity)."""
        return list(self.cpu_pool.cached) if self.host_tier else []
