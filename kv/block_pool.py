"""KV block accounting: block ids, reference counts, the free LRU list and the prefix-cache index.

Pure Python (no torch): the tensors that hold K/V live in `kv.cache_engine`; this module only
decides which block ids hold what.

A block is in exactly one of three states:
  * in use    - ref_cnt > 0 (one or more requests' block tables point at it)
  * cached    - ref_cnt == 0, on the free list, still registered under its hash: a later request
                with the same prefix can take it back from the middle of the free list in O(1)
  * free      - ref_cnt == 0, on the free list, no hash
Allocation takes from the head of the free list (least recently freed first), evicting the hash
of a cached block it takes. That is what makes the free list LRU.

KV shares (`set_reserves`): a block allocated for a tenant is owned by it until it is plain
free again; a tenant holds its in-use and cached blocks. With reserves set, an allocation
takes, in LRU order, plain free blocks and cached ones of tenants holding more than their
reserve first, and only then the cached blocks of tenants within theirs (the scheduler keeps
other tenants' preemption off a tenant within its reserve).

The host tier (kv/manager.py) is a second pool of this class: with `evicted` set to a list,
the device pool records each cached block it hands out for other tokens there, so its K/V can
be kept in host memory under the same hash before anything overwrites it.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterable, Sequence


class KVBlock:
    """One block of `block_size` token slots. Threaded into the free list by prev/next."""

    __slots__ = (
        "block_id",
        "ref_cnt",
        "block_hash",
        "token_bytes",
        "prev_free",
        "next_free",
        "owner",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None  # set while registered in the prefix cache
        self.token_bytes: bytes | None = None  # pack_tokens() of the tokens the hash covers
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None
        self.owner: str | None = None  # the tenant it was allocated for, while not plain free

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


def hash_block(parent: bytes | None, token_ids: Sequence[int], salt: str | None) -> bytes:
    """Chained hash of one full block, stable across processes (the controller compares hashes
    from different replicas, so Python's per-process salted `hash()` would not do).

    The salt (a tenant or sharing group) enters the first block only; the chain carries it on.
    """
    return hash_packed(parent, pack_tokens(token_ids), salt)


def hash_packed(parent: bytes | None, token_bytes: bytes, salt: str | None) -> bytes:
    """`hash_block` of tokens already packed by `pack_tokens`: blake2b-128 of the parent hash
    (or, for a first block, a tag and the salt) followed by the packed tokens."""
    if parent is None:
        parent = _chain_start(salt)
    return _blake2b(parent + token_bytes, digest_size=16).digest()


def _chain_start(salt: str | None) -> bytes:
    """What a first block's hash covers in place of a parent hash: a tag and the salt."""
    return b"\x00" if salt is None else b"\x01" + salt.encode()


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32s: what a block's hash covers and what a cache hit is
    checked against (one bytes object: no per-token objects to keep alive or free). Four
    bytes a token keep a 16-token block and its parent hash (80 bytes) within one 128-byte
    BLAKE2b block: one compression a hash instead of two. Token ids are vocabulary indices,
    so `Request` admits only 0 <= id < 2**32."""
    n = len(token_ids)
    try:
        return (_PACKERS.get(n) or _packer(n))(*token_ids)
    except struct.error:
        bad = next((t for t in token_ids if not (isinstance(t, int) and 0 <= t < 2**32)), None)
        raise ValueError(f"token ids must be integers in [0, 2**32), got {bad!r}") from None


def _packer(n: int) -> Callable[..., bytes]:
    packer = _PACKERS[n] = struct.Struct(f"<{n}I").pack  # _TOKEN_BYTES each
    return packer


_blake2b = hashlib.blake2b
_BLAKE2B_128 = _blake2b(digest_size=16)  # never updated: extend_chain hashes with copies
_TOKEN_BYTES = 4  # pack_tokens: uint32 a token
_PACKERS: dict[int, Callable[..., bytes]] = {}  # block length -> its struct packer


class FreeBlockQueue:
    """Doubly linked list of free blocks with sentinel head and tail.

    A list (or deque) would make taking a cached block out of the middle O(n); threading the
    links through the blocks themselves makes extend, popleft_n and remove O(1) per block.
    """

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self.head = KVBlock(-1)  # sentinel: head.next_free is the next block to allocate
        self.tail = KVBlock(-1)  # sentinel: tail.prev_free is the most recently freed block
        self.head.next_free = self.tail
        self.tail.prev_free = self.head
        self.num_free = 0
        self.extend(blocks)

    def extend(self, blocks: Iterable[KVBlock]) -> None:
        """Append blocks at the tail in the order given (a finished request's: one call)."""
        tail = self.tail
        last = tail.prev_free
        assert last is not None
        n = 0
        for block in blocks:
            last.next_free = block
            block.prev_free = last
            last = block
            n += 1
        last.next_free = tail
        tail.prev_free = last
        self.num_free += n

    def popleft_n(self, n: int) -> list[KVBlock]:
        """The first n blocks, unlinked as one run (a step's allocations: one call, not n)."""
        if n > self.num_free:
            raise IndexError(f"{n} blocks asked, {self.num_free} free")
        out = []
        block = self.head.next_free
        for _ in range(n):  # n <= num_free: never runs into the tail sentinel
            out.append(block)
            nxt = block.next_free
            block.prev_free = block.next_free = None
            block = nxt
        assert block is not None
        self.head.next_free = block
        block.prev_free = self.head
        self.num_free -= n
        return out

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not on the free list")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def __iter__(self):
        block = self.head.next_free
        while block is not self.tail:
            assert block is not None
            yield block
            block = block.next_free


class BlockPool:
    """A fixed set of blocks with O(1) allocate/free, reference counts and a prefix-cache index.

    Contracts:
      * `allocate(n)` returns n blocks with ref_cnt 1 taken from the head of the free list
        (evicting their cache entries), or raises ValueError if fewer than n are free.
      * `free(blocks)` decrements each block's ref_cnt; blocks reaching 0 join the free list's
        tail in the order given (the caller orders them: evict-first first).
      * `touch(blocks)` takes a reference on blocks found in the cache, pulling ref_cnt-0 blocks
        off the free list.
      * `lookup(hash, tokens)` returns a registered block only if its stored tokens match.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}
        # Bumped whenever `cached` gains or loses an entry: a lookup's answer depends on nothing
        # else, so answers memoized at one version hold until it moves (KVCacheManager's memo).
        self.version = 0
        self.reserves: dict[str, int] = {}  # tenant -> blocks kept for it (KV shares)
        self.held: dict[str, int] = {}  # tenant -> blocks it owns, in use or cached
        self.num_evicted = 0  # cached blocks handed out for other tokens, ever
        # None, or where `allocate` appends (block id, hash, packed tokens, owner) of each
        # cached block it evicts, its K/V still intact (the host tier drains it)
        self.evicted: list[tuple[int, bytes, bytes, str | None]] | None = None

    def set_reserves(self, reserves: dict[str, int]) -> None:
        """Blocks to keep for each tenant: its cached blocks are evicted last while it holds
        no more than that. Their sum must fit the pool."""
        if sum(reserves.values()) > self.num_blocks or min(reserves.values(), default=0) < 0:
            raise ValueError(f"reserves {reserves} do not fit {self.num_blocks} blocks")
        self.reserves = dict(reserves)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (free or cached-but-unused)."""
        return self.free_queue.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.free_queue.num_free

    def allocate(self, n: int, owner: str | None = None) -> list[KVBlock]:
        """n blocks for `owner` (a tenant, or None: untracked)."""
        if n > self.free_queue.num_free:
            raise ValueError(f"cannot allocate {n} blocks: only {self.free_queue.num_free} free")
        out = self._take_reserved(n) if self.reserves else self.free_queue.popleft_n(n)
        return self._claim(out, owner)

    def allocate_within_share(self, owner: str | None) -> KVBlock | None:
        """One block for `owner` that no tenant within its reserve loses: in LRU order a plain
        free block, a cached one of `owner` or of a tenant holding more than its reserve;
        None if there is none (the host tier's rule: a tenant's histories never flush another
        tenant's share; a store that finds no block is dropped)."""
        if not self.reserves:
            return self.allocate(1, owner)[0] if self.free_queue.num_free else None
        reserves, held = self.reserves, self.held
        for block in self.free_queue:
            other = block.owner
            if other is None or other == owner or held.get(other, 0) > reserves.get(other, 0):
                self.free_queue.remove(block)
                return self._claim([block], owner)[0]
        return None

    def _claim(self, out: list[KVBlock], owner: str | None) -> list[KVBlock]:
        """Blocks just taken off the free list, allocated to `owner` (see `allocate`)."""
        cached, held, evicted = self.cached, self.held, self.evicted
        for block in out:
            block_hash = block.block_hash
            if block_hash is not None:  # a cached block, reused for other tokens: forget it
                del cached[block_hash]  # (a block carries a hash only while indexed under it)
                if evicted is not None:
                    evicted.append((block.block_id, block_hash, block.token_bytes, block.owner))
                block.block_hash = block.token_bytes = None
                self.version += 1
                self.num_evicted += 1
            if block.owner is not None:
                held[block.owner] -= 1
            block.owner = owner
            block.ref_cnt = 1
        if owner is not None and out:
            held[owner] = held.get(owner, 0) + len(out)
        return out

    def set_owner(self, blocks: Iterable[KVBlock], owner: str | None) -> None:
        """Blocks just allocated untracked (one call for several requests) go to `owner`."""
        held = self.held
        for block in blocks:
            if block.owner is not None:
                held[block.owner] -= 1
            block.owner = owner
            if owner is not None:
                held[owner] = held.get(owner, 0) + 1

    def _take_reserved(self, n: int) -> list[KVBlock]:
        """The n free blocks to allocate under reserves: in LRU order, plain free ones and
        cached ones of owners over their reserve, then the rest in LRU order."""
        reserves, held = self.reserves, dict(self.held)
        first: list[KVBlock] = []
        rest: list[KVBlock] = []
        for block in self.free_queue:
            owner = block.owner
            if owner is None or held.get(owner, 0) > reserves.get(owner, 0):
                first.append(block)
                if owner is not None:
                    held[owner] -= 1
                if len(first) == n:
                    break
            elif len(rest) < n:
                rest.append(block)
        out = first + rest[: n - len(first)]
        for block in out:
            self.free_queue.remove(block)
        return out

    def free(self, blocks: Iterable[KVBlock]) -> None:
        released = []
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                released.append(block)
                if block.owner is not None and block.block_hash is None:  # plain free now
                    self.held[block.owner] -= 1
                    block.owner = None
            elif block.ref_cnt < 0:
                self.free_queue.extend(released)
                raise AssertionError(f"double free of {block}")
        self.free_queue.extend(released)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def lookup(self, block_hash: bytes, token_ids: Sequence[int]) -> KVBlock | None:
        return self.lookup_packed(block_hash, pack_tokens(token_ids))

    def lookup_packed(self, block_hash: bytes, token_bytes: bytes) -> KVBlock | None:
        """`lookup` with the tokens already packed by `pack_tokens`."""
        block = self.cached.get(block_hash)
        if block is None or block.token_bytes != token_bytes:
            return None  # a hash collision must never hand out someone else's K/V
        return block

    def cache(self, block: KVBlock, block_hash: bytes, token_ids: Sequence[int]) -> None:
        """Register a full, computed block under its hash (first writer wins on duplicates)."""
        self.register([block], [block_hash], [pack_tokens(token_ids)], 0, 1)

    def extend_chain(
        self,
        token_ids: Sequence[int],
        hashes: list[bytes],
        packed: list[bytes],
        num_blocks: int,
        salt: str | None,
    ) -> None:
        """Hash a sequence's full blocks from `len(hashes)` up to `num_blocks`: append each
        block's chained hash (`hash_packed`) to `hashes` and its `pack_tokens` bytes to `packed`
        (what a hit is checked against). One struct call packs the whole run."""
        first = len(hashes)
        if first >= num_blocks:
            return
        bs = self.block_size
        width = _TOKEN_BYTES * bs
        run = pack_tokens(token_ids[first * bs : num_blocks * bs])
        block_hash = hashes[-1] if first else _chain_start(salt)
        new_hasher = _BLAKE2B_128.copy  # a copy skips blake2b()'s parameter parsing
        for offset in range(0, len(run), width):
            block_bytes = run[offset : offset + width]
            # hash_packed, inline: the chain's parent is the previous block's hash
            hasher = new_hasher()
            hasher.update(block_hash)
            hasher.update(block_bytes)
            block_hash = hasher.digest()
            hashes.append(block_hash)
            packed.append(block_bytes)

    def register(
        self,
        blocks: Sequence[KVBlock],
        hashes: Sequence[bytes],
        packed: Sequence[bytes],
        start: int,
        stop: int,
    ) -> None:
        """Register blocks[start:stop] of one sequence, block i under `hashes[i]` with tokens
        `packed[i]` (see `extend_chain`). A block already registered keeps its entry, and a
        hash already registered keeps its block (first writer wins)."""
        if not self.enable_caching:
            return
        cached = self.cached
        for i in range(start, stop):
            block = blocks[i]
            block_hash = hashes[i]
            if block.block_hash is None and block_hash not in cached:
                block.block_hash = block_hash
                block.token_bytes = packed[i]
                cached[block_hash] = block
                self.version += 1

    def reset_cache(self) -> None:
        """Forget every cached hash (blocks in use keep their contents but stop being shareable)."""
        for block in self.cached.values():
            block.block_hash = None
            block.token_bytes = None
            if block.ref_cnt == 0 and block.owner is not None:  # plain free now
                self.held[block.owner] -= 1
                block.owner = None
        self.cached.clear()
        self.version += 1

    def counts(self) -> tuple[int, int, int]:
        """(free, cached, in use) block counts."""
        num_cached_free = sum(1 for b in self.cached.values() if b.ref_cnt == 0)
        free_total = self.free_queue.num_free
        return free_total - num_cached_free, num_cached_free, self.num_blocks - free_total

    def check_integrity(self) -> None:
        """Assert free + cached + in use == total and that every link and count agrees."""
        on_list = list(self.free_queue)
        assert len(on_list) == self.free_queue.num_free, "free count disagrees with the list"
        on_list_ids = {b.block_id for b in on_list}
        assert len(on_list_ids) == len(on_list), "a block is on the free list twice"
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"{block} has a negative ref count"
            if block.ref_cnt == 0:
                assert block.block_id in on_list_ids, f"{block} is unreferenced but not free"
            else:
                assert block.block_id not in on_list_ids, f"{block} is referenced and on the list"
        for h, block in self.cached.items():
            assert block.block_hash == h, f"{block} is indexed under a hash it does not carry"
        for block in self.blocks:
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, f"{block} hash not indexed"
        # counted independently of counts() (which derives "in use" from the free count)
        in_use = sum(1 for b in self.blocks if b.ref_cnt > 0)
        cached_free = sum(1 for b in on_list if b.block_hash is not None)
        assert len(on_list) + in_use == self.num_blocks, "free + cached + in use != total"
        free = len(on_list) - cached_free
        assert self.counts() == (free, cached_free, in_use), "counts() disagrees with the blocks"
        held: dict[str, int] = {}
        for block in self.blocks:
            if block.owner is not None:
                assert block.ref_cnt > 0 or block.block_hash is not None, f"{block} owned, free"
                held[block.owner] = held.get(block.owner, 0) + 1
        assert held == {t: n for t, n in self.held.items() if n}, "held counts disagree"
