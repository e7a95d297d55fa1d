"""KVCacheManager: the narrow seam between the scheduler and KV memory.

The scheduler only ever asks: which prefix is already computed (`get_computed_blocks`), can this
request get slots for n more tokens (`allocate_slots` -> block ids | None, None meaning "preempt
someone and retry"), and give everything back (`free`); `fork` starts a sibling sample of a
prompt on its parent's blocks. Host memory (a second pool of CPU blocks) sits here too, so one
object knows where every request's K/V lives.

Host memory holds swap space and, with `host_tier`, the prefix cache's second tier, in one
pool: see kv/host_tier.py.

Pure Python: no torch. Requests are duck-typed: `.request_id`, `.all_token_ids`,
`.num_computed_tokens`, `.cache_salt`.
"""

from __future__ import annotations

from fairbatch.kv.block_pool import BlockPool, KVBlock
from fairbatch.kv.host_tier import HostTier


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tenant_of(request) -> str | None:
    return getattr(request, "tenant", None)


class KVCacheManager(HostTier):
    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = True,
        host_tier: bool = False,
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.gpu_pool = BlockPool(num_gpu_blocks, block_size, enable_prefix_caching)
        # Swapped blocks are never registered: one request's swapped K/V is private to it.
        self.host_tier = host_tier and enable_prefix_caching and num_cpu_blocks > 0
        self.cpu_pool = BlockPool(max(num_cpu_blocks, 1), block_size, self.host_tier)
        self.num_cpu_blocks = num_cpu_blocks
        if self.host_tier:
            self.gpu_pool.evicted = []
        self._host_reads: list[KVBlock] = []  # host blocks this step's copies read (held)
        self.num_stored_blocks = 0  # device blocks kept in the host tier (copies issued)
        self.num_loaded_blocks = 0  # host-tier blocks loaded back to the device
        self.req_blocks: dict[str, list[KVBlock]] = {}  # request id -> its GPU blocks, in order
        # the same as ids: the live block table. It only grows in place; a table rebuilt
        # (new, swapped in) is a new list (the runner keeps array copies by list: IntRows)
        self.req_block_ids: dict[str, list[int]] = {}
        self.req_hashes: dict[str, list[bytes]] = {}  # hashes of the request's full blocks
        # ... and each of those blocks' tokens as pack_tokens() bytes (what a hit is checked
        # against, and what a registered block keeps): packed once, when hashed
        self.req_packed: dict[str, list[bytes]] = {}
        self.num_cached: dict[str, int] = {}  # how many leading blocks are registered in the cache
        self.swapped: dict[str, list[KVBlock]] = {}  # request id -> its CPU blocks
        # num_cached_prefix_tokens' memo, for the gpu pool's cache at `_hit_memo_version`:
        # first block hash -> (hashes, packed tokens, blocks hit) of the request with that first
        # block that hit the most blocks (see there)
        self._hit_memo: dict[bytes, tuple[list[bytes], list[bytes], int]] = {}
        self._hit_memo_version = -1

    def set_kv_shares(self, shares: dict[str, float]) -> None:
        """Keep floor(share x GPU blocks) for each tenant: its cached blocks are evicted last
        while it holds no more (`BlockPool.set_reserves`); the scheduler reads `reserve` to keep
        other tenants' preemption off them. Shares are in (0, 1] and sum to <= 1."""
        for tenant, share in shares.items():
            if not 0 < share <= 1:
                raise ValueError(f"kv_share of {tenant!r} must be in (0, 1], got {share!r}")
        if sum(shares.values()) > 1 + 1e-9:
            raise ValueError(f"kv_share values sum to {sum(shares.values()):g} > 1")
        for pool in (self.gpu_pool, self.cpu_pool) if self.host_tier else (self.gpu_pool,):
            n = pool.num_blocks
            pool.set_reserves({t: int(share * n) for t, share in shares.items()})

    def reserve(self, tenant: str) -> int:
        """GPU blocks kept for `tenant` (0 without a share)."""
        return self.gpu_pool.reserves.get(tenant, 0)

    # ---- GPU blocks -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.gpu_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.gpu_pool.num_used_blocks / self.gpu_pool.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (a live list: it grows as blocks are allocated)."""
        return self.req_block_ids.get(request_id, [])

    def num_blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def hash_prompt(self, request) -> None:
        """Hash the full blocks of a new request's tokens, at intake (as vLLM does when a
        request is created): the admission's cache lookup and the registration after its
        prefill then find the hashes and packed tokens made. Requests that skip this are
        hashed as they go."""
        if self.enable_prefix_caching:
            hashes, packed = self._chain(request.request_id)
            num_full = len(request.all_token_ids) // self.block_size
            self.gpu_pool.extend_chain(
                request.all_token_ids, hashes, packed, num_full, request.cache_salt
            )

    def _chain(self, rid: str) -> tuple[list[bytes], list[bytes]]:
        """The request's block hashes and packed block tokens so far (created empty)."""
        hashes = self.req_hashes.get(rid)
        if hashes is None:
            hashes = self.req_hashes[rid] = []
            self.req_packed[rid] = []
        return hashes, self.req_packed[rid]

    def get_computed_blocks(self, request) -> tuple[list[KVBlock], int]:
        """Cached blocks holding a prefix of the request's tokens, and how many tokens they cover.

        Only for a request with no blocks yet. At least one token is always left to compute,
        because the step that computes it produces the logits for the next token. Blocks not
        hashed yet (see `hash_prompt`) are hashed only as far as the lookups go.
        """
        if not self.enable_prefix_caching or request.request_id in self.req_blocks:
            return [], 0
        hits = self._cached_run(self.gpu_pool, request, 0)
        return hits, len(hits) * self.block_size

    def _cached_run(self, pool: BlockPool, request, start: int) -> list[KVBlock]:
        """`pool`'s cached blocks holding the request's blocks `start`, `start` + 1, ... (by
        salted hash and token check), up to the first miss; never its last token's block."""
        hashes, packed = self._chain(request.request_id)
        tokens, bs = request.all_token_ids, self.block_size
        hits: list[KVBlock] = []
        for i in range(start, (len(tokens) - 1) // bs):
            if i == len(hashes):
                pool.extend_chain(tokens, hashes, packed, i + 1, request.cache_salt)
            block = pool.lookup_packed(hashes[i], packed[i])
            if block is None:
                break
            hits.append(block)
        return hits

    def num_cached_prefix_tokens(self, request) -> int:
        """The token count `get_computed_blocks` would return now, changing nothing: no hash is
        stored, no block touched (for a policy that orders waiting requests by cache hits).
        Uses the hashes made at intake; blocks past them are hashed on the side, only as far as
        the hits go.

        lpm / dlpm ask this for every waiting request at every pick, and the requests of one
        system prompt share its leading blocks: while the cache index is unchanged, a request
        whose leading blocks (hashes and tokens) equal those of an earlier request with the
        same first block takes that one's hits for them from one list comparison, and looks
        up only the blocks after. O(blocks hit + 1) lookups for the first request of a
        prefix, O(1) lookups (plus C-speed comparisons) for the others."""
        if not self.enable_prefix_caching or request.request_id in self.req_blocks:
            return 0
        rid = request.request_id
        hashes = self.req_hashes.get(rid, [])
        packed = self.req_packed.get(rid, [])
        tokens, bs = request.all_token_ids, self.block_size
        pool = self.gpu_pool
        memo = self._hit_memo
        if self._hit_memo_version != pool.version:
            memo.clear()
            self._hit_memo_version = pool.version
        num_blocks = (len(tokens) - 1) // bs
        num_hit = 0
        seen = memo.get(hashes[0]) if hashes else None
        if seen is not None:
            n = min(seen[2], num_blocks)
            # the same (hash, tokens) pairs as blocks that hit at this version: hits too
            if hashes[:n] == seen[0][:n] and packed[:n] == seen[1][:n]:
                num_hit = n
        stored = True
        for i in range(num_hit, num_blocks):
            if i == len(hashes):
                if stored:  # extend copies, never the request's own chain
                    hashes, packed, stored = list(hashes), list(packed), False
                pool.extend_chain(tokens, hashes, packed, i + 1, request.cache_salt)
            if pool.lookup_packed(hashes[i], packed[i]) is None:
                break
            num_hit += 1
        if num_hit and (seen is None or num_hit > seen[2]):
            # (chains only ever grow, so the first num_hit entries stay what they are now)
            memo[hashes[0]] = (hashes, packed, num_hit)
        return num_hit * bs

    def allocate_slots(
        self, request, num_new_tokens: int, new_computed_blocks: list[KVBlock] | None = None
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        `new_computed_blocks` (from get_computed_blocks, for a request being admitted) are
        taken over first; the caller has not yet advanced num_computed_tokens past them.
        Returns the newly allocated block ids, or None (nothing changed) if the pool is short.
        """
        rid = request.request_id
        bs = self.block_size
        blocks = self.req_blocks.get(rid)
        num_have = 0 if blocks is None else len(blocks)
        num_computed = request.num_computed_tokens
        num_evictable = 0
        if new_computed_blocks:
            num_computed += len(new_computed_blocks) * bs
            num_have += len(new_computed_blocks)
            # Cached hits with no other user sit on the free list: taking them uses free blocks.
            num_evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        num_new = cdiv(num_computed + num_new_tokens, bs) - num_have
        if num_new > self.gpu_pool.free_queue.num_free - num_evictable:
            return None
        if blocks is None:
            blocks = self._new_table(rid)
        if new_computed_blocks:
            self.gpu_pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            self.req_block_ids[rid].extend(b.block_id for b in new_computed_blocks)
            self.num_cached[rid] = len(blocks)
        if num_new <= 0:
            return []
        return self._append(rid, blocks, self.gpu_pool.allocate(num_new, tenant_of(request)))

    def fork(self, parent, child, num_tokens: int) -> list[tuple[int, int]] | None:
        """Give `child` (no blocks yet) the parent's K/V of positions < `num_tokens`: the full
        blocks by reference (ref count + 1 each) and a partly filled last block as a copy in a
        new block of its own (copy on write: both will write the rest of that block). Returns
        the (src, dst) block copies to issue before the child's next forward, or None
        (nothing changed) when no block is free for the copy."""
        bs = self.block_size
        num_full, partial = divmod(num_tokens, bs)
        src = self.req_blocks[parent.request_id]
        if partial and not self.gpu_pool.num_free_blocks:
            return None
        cid = child.request_id
        blocks = self._new_table(cid)
        shared = src[:num_full]
        self.gpu_pool.touch(shared)  # all in use by the parent: none leaves the free list
        self._append(cid, blocks, shared)
        self.num_cached[cid] = min(self.num_cached[parent.request_id], num_full)
        if not partial:
            return []
        (copy,) = self.gpu_pool.allocate(1, tenant_of(child))
        self._append(cid, blocks, [copy])
        return [(src[num_full].block_id, copy.block_id)]

    def _new_table(self, rid: str) -> list[KVBlock]:
        blocks = self.req_blocks[rid] = []
        self.req_block_ids[rid] = []
        self.num_cached[rid] = 0
        return blocks

    def _append(self, rid: str, blocks: list[KVBlock], new_blocks: list[KVBlock]) -> list[int]:
        blocks.extend(new_blocks)
        new_ids = [b.block_id for b in new_blocks]
        self.req_block_ids[rid].extend(new_ids)
        return new_ids

    def cache_computed_blocks(self, request) -> None:
        """Register the request's full, computed blocks in the prefix cache.

        Called after a step advanced num_computed_tokens, never at allocation: a request can be
        preempted between allocation and compute, and a block registered then would hand out
        K/V that was never written. `free` registers whatever computed blocks are left, so a
        caller may skip this for blocks nobody else can want yet (a running request's newest
        output: the scheduler does, for plain decodes).
        """
        if self.enable_prefix_caching and request.request_id in self.req_blocks:
            self._cache_full_blocks(request, request.num_computed_tokens // self.block_size)

    def _cache_full_blocks(self, request, num_full: int) -> None:
        rid = request.request_id
        start = self.num_cached[rid]
        if num_full <= start:
            return
        hashes, packed = self._chain(rid)
        self.gpu_pool.extend_chain(
            request.all_token_ids, hashes, packed, num_full, request.cache_salt
        )
        self.gpu_pool.register(self.req_blocks[rid], hashes, packed, start, num_full)
        self.num_cached[rid] = num_full

    def free(self, request) -> None:
        """Release the request's GPU (and any CPU swap) blocks, tail blocks first so the prefix
        blocks, the likeliest to be reused, are the last evicted."""
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        if blocks is not None:
            if self.enable_prefix_caching:
                # computed blocks not registered yet (the scheduler leaves the ones decodes fill
                # to this point: one call per request instead of one per block)
                num_full = min(request.num_computed_tokens // self.block_size, len(blocks))
                self._cache_full_blocks(request, num_full)
            del self.req_blocks[rid]
            self.gpu_pool.free(reversed(blocks))
        self.req_block_ids.pop(rid, None)
        self.num_cached.pop(rid, None)
        cpu_blocks = self.swapped.pop(rid, None)
        if cpu_blocks is not None:
            self.cpu_pool.free(cpu_blocks)

    def forget(self, request) -> None:
        """Free everything and drop the cached hashes (the request is finished)."""
        self.free(request)
        self.req_hashes.pop(request.request_id, None)
        self.req_packed.pop(request.request_id, None)

    # ---- swap space -------------------------------------------------------------------------

    def can_swap_out(self, request) -> bool:
        n = len(self.req_blocks.get(request.request_id, ()))
        return self.num_cpu_blocks > 0 and n <= self.cpu_pool.num_free_blocks

    def swap_out(self, request) -> list[tuple[int, int]]:
        """Move the request's K/V to CPU blocks: returns (gpu block, cpu block) copies to issue
        before the next forward. Its GPU blocks are freed (full ones stay findable in the cache)."""
        rid = request.request_id
        if not self.can_swap_out(request):
            raise ValueError(f"not enough CPU swap space for {rid}")
        gpu_blocks = self.req_blocks[rid]
        cpu_blocks = self.cpu_pool.allocate(len(gpu_blocks))
        mapping = [(g.block_id, c.block_id) for g, c in zip(gpu_blocks, cpu_blocks)]
        self.free(request)
        self.swapped[rid] = cpu_blocks
        return mapping

    def num_swapped_blocks(self, request) -> int:
        return len(self.swapped.get(request.request_id, ()))

    def can_swap_in(self, request, num_extra_blocks: int = 0) -> bool:
        need = self.num_swapped_blocks(request) + num_extra_blocks
        return need <= self.gpu_pool.num_free_blocks

    def swap_in(self, request) -> list[tuple[int, int]]:
        """Bring a swapped request back: returns (cpu block, gpu block) copies. The CPU blocks
        are freed at once; the caller must not reuse swap space before issuing these copies."""
        rid = request.request_id
        if not self.can_swap_in(request):
            raise ValueError(f"not enough GPU blocks to swap in {rid}")
        cpu_blocks = self.swapped.pop(rid)
        gpu_blocks = self.gpu_pool.allocate(len(cpu_blocks), tenant_of(request))
        self.req_blocks[rid] = gpu_blocks
        self.req_block_ids[rid] = [b.block_id for b in gpu_blocks]
        self.num_cached[rid] = 0
        self._read(cpu_blocks)
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, request.num_computed_tokens // self.block_size)
        return [(c.block_id, g.block_id) for c, g in zip(cpu_blocks, gpu_blocks)]

    # ---- migration: swap space filled from / handed to another replica -----------------------

    def export_swapped(self, request) -> list[int]:
        """CPU block ids holding a swapped request's K/V, in order (for the copy engine to read).
        The blocks stay allocated until `free(request)`."""
        return [b.block_id for b in self.swapped[request.request_id]]

    def import_swapped(self, request, num_blocks: int) -> list[int] | None:
        """Reserve CPU blocks for a request arriving from another replica; None if no room."""
        if num_blocks > self.cpu_pool.num_free_blocks or self.num_cpu_blocks == 0:
            return None
        blocks = self.cpu_pool.allocate(num_blocks)
        self.swapped[request.request_id] = blocks
        return [b.block_id for b in blocks]

    # ---- introspection ----------------------------------------------------------------------

    def cached_hashes(self) -> list[bytes]:
        """Hashes of the blocks this pool can serve from cache (reported for prefix affinity)."""
        return list(self.gpu_pool.cached)

    def check_integrity(self) -> None:
        self.gpu_pool.check_integrity()
        self.cpu_pool.check_integrity()
        refs: dict[int, int] = {}
        for blocks in self.req_blocks.values():
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in self.gpu_pool.blocks:
            assert b.ref_cnt == refs.get(b.block_id, 0), f"{b}: ref count != block-table uses"
        for rid, blocks in self.req_blocks.items():
            assert self.req_block_ids[rid] == [b.block_id for b in blocks], f"{rid} table stale"
        assert self.req_packed.keys() == self.req_hashes.keys(), "hash and token chains differ"
        for rid, hashes in self.req_hashes.items():
            assert len(self.req_packed[rid]) == len(hashes), f"{rid}: tokens packed != hashed"
        host_refs: dict[int, int] = {}
        for blocks in [*self.swapped.values(), self._host_reads]:
            for b in blocks:
                host_refs[b.block_id] = host_refs.get(b.block_id, 0) + 1
        for b in self.cpu_pool.blocks:
            assert b.ref_cnt == host_refs.get(b.block_id, 0), f"host {b}: swap blocks leaked"
        for blocks in self.swapped.values():
            assert all(b.block_hash is None for b in blocks), "a swapped block is shareable"

    def all_free(self) -> bool:
        """True when no request holds any block (cached blocks count as free)."""
        return (
            self.gpu_pool.num_free_blocks == self.gpu_pool.num_blocks
            and self.cpu_pool.num_used_blocks == len({b.block_id for b in self._host_reads})
        )
