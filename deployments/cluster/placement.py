"""Where a request goes: the controller's replica table, their loads, and the prefix index.

`Placement` is part of `FairnessCore` (fairness.py), plain Python. In "fair" routing, `pick`
prefers the replica caching the longest prefix of the prompt (at most `AFFINITY_PROBES`
holders looked at per prompt block), then the least loaded one: loads live in a heap with lazy
deletion (an entry whose version is stale is skipped), so a pick is O(log R), no scan. The
cache wins only where the request would start at once (the holder has a free seat) or wait no
longer than elsewhere (no replica has fewer requests): a hit saves one prefill, a place in a
full replica's local queue costs a whole request's decode while another replica's seat idles.
A LoRA request with no cached prefix goes, on the same terms, to a replica holding its adapter
in a slot (as its last report said; a scan of the replicas, for LoRA requests only); else to
the least loaded, which loads it: Ray Serve's model multiplexing and S-LoRA also prefer the
replicas holding the model. The baselines ("round_robin", "power_of_two") route over the
replicas in registration order; "prefix_affinity" routes at once to the replica caching the
longest prefix (else the least loaded), whatever its load: locality first, as cache-aware
routers do.

"d2lpm" (after the D2LPM of Cao et al., arXiv:2501.14312, with our own deficit): the global
queue is served as in "fair", and the replica is chosen among those that cache at least
`min_match` of the prompt's leading blocks, have room, a load <= the least load + `load_slack`,
and where the tenant still has deficit: its requests placed there for locality and not yet
ended may hold at most `quantum * weight` weighted tokens (input_weight x prompt + output_weight
x max_tokens each). The longest match wins (then the lower load); with no such replica the
least loaded one takes it. So locality can neither pile a replica up beyond `load_slack` over
the others nor let one tenant fill a replica's seats by its hits; which tenant goes next is the
global policy's order over the cluster-wide counters, whatever the routing.

Prefixes in a replica's host KV tier (kv/host_tier.py) are hits too: a replica reports them in
the same list, tagged (`report_hashes`). Every routing counts them as cached; d2lpm ranks a
match by its device blocks plus `host_hit_weight` (< 1) per host block, since loading a block
over the host link costs more than finding it on the device and far less than its prefill.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from fairbatch.deployments.cluster.tickets import Ticket

AFFINITY_PROBES = 4  # replicas looked at per prompt block when matching prefixes
HOST_TAG = b"H"  # before a reported hash: the block is in the replica's host tier


def report_hashes(device: Iterable[bytes], host: Iterable[bytes]) -> list[bytes]:
    """A replica's cached prefixes as it reports them: its device block hashes as they are,
    its host-tier ones tagged (a block in both is a device hit)."""
    device = list(device)
    on_device = set(device)
    return device + [HOST_TAG + h for h in host if h not in on_device]


def split_hashes(hashes: Iterable[bytes]) -> tuple[set[bytes], set[bytes]]:
    """`report_hashes`' (device, host) sets. Untagged hashes are 16 bytes: a tagged one, 17."""
    device, host = set(), set()
    for h in hashes:
        if len(h) == 17 and h[:1] == HOST_TAG:
            host.add(h[1:])
        else:
            device.add(h)
    return device, host - device


class ReplicaState:
    __slots__ = (
        "replica_id",
        "index",
        "slots",
        "seats",
        "assigned",
        "alive",
        "free_blocks",
        "total_blocks",
        "block_size",
        "service",
        "hashes",
        "host_hashes",
        "last_seq",
        "version",
        "synced",
        "locality",
        "loras",
    )

    def __init__(self, replica_id: str, index: int, slots: int, seats: int) -> None:
        self.replica_id = replica_id
        self.index = index
        self.slots = slots  # running seats + local queue
        self.seats = seats  # running seats
        self.assigned: dict[str, Ticket] = {}
        self.alive = True
        self.free_blocks = 0
        self.total_blocks = 0
        self.block_size = 16
        self.service: dict[str, tuple[int, int]] = {}  # last cumulative report
        self.hashes: set[bytes] = set()  # cached prefix blocks, device and host tier
        self.host_hashes: set[bytes] = set()  # ... of which only in the host tier
        self.last_seq = -1
        self.version = 0  # heap entries with another version are stale
        self.synced = False  # has this controller seen a report from it yet
        self.locality: dict[str, float] = {}  # d2lpm: tenant -> in-flight locality work here
        self.loras: frozenset[str] = frozenset()  # LoRA adapters in its slots, last reported

    @property
    def load(self) -> int:
        return len(self.assigned)

    def has_room(self) -> bool:
        return self.alive and len(self.assigned) < self.slots

    def takes_for_locality(self, least_load: int) -> bool:
        """May a cached prefix bring a request here? Only to a free seat, or to a queue no
        longer than the least loaded replica's (`least_load`)."""
        n = len(self.assigned)
        return self.alive and n < self.slots and (n < self.seats or n <= least_load)


@dataclass
class Locality:
    """The d2lpm settings (see the module doc)."""

    quantum: float = 8192.0
    min_match: float = 0.5
    load_slack: int = 2
    input_weight: float = 1.0
    output_weight: float = 2.0
    weights: dict[str, float] = field(default_factory=dict)  # tenant -> weight (default 1)
    host_hit_weight: float = 0.8  # a host-tier block's worth in a match, a device block's 1

    def cost(self, t: Ticket) -> float:
        meta = t.meta
        prompt = 0 if meta is None else meta.num_charged_prompt_tokens
        return self.input_weight * prompt + self.output_weight * t.max_tokens

    def allowance(self, tenant: str) -> float:
        return self.quantum * self.weights.get(tenant, 1.0)


class Placement:
    def __init__(self, routing: str, rng: random.Random, locality: Locality | None = None) -> None:
        self.routing = routing
        self.rng = rng
        self.locality = locality or Locality()
        self.replicas: dict[str, ReplicaState] = {}
        self._heap: list[tuple[int, int, int, ReplicaState]] = []  # (load, index, version, r)
        self._indices = itertools.count()
        self._rr = 0
        self._alive: list[ReplicaState] = []  # registration order (baseline routing)
        self.hash_index: dict[bytes, set[str]] = {}  # prefix block hash -> replicas caching it
        self._roomy: list[ReplicaState] | None = None  # replicas with room (None: recompute)
        self._hits: dict[bytes, int] = {}  # cached_prefix_tokens per prefix, while _roomy holds
        # replicas holding more requests than seats: some wait in their local queue
        self.queueing: set[ReplicaState] = set()

    # ---- the replica table ------------------------------------------------------------------

    def add(self, replica_id: str, seats: int, local_queue: int = 0) -> ReplicaState:
        """Register (or refresh) a replica with `seats` running seats and `local_queue` places
        for requests sent ahead of a free seat."""
        slots = seats + local_queue
        r = self.replicas.get(replica_id)
        if r is None:
            r = ReplicaState(replica_id, next(self._indices), slots, seats)
            self.replicas[replica_id] = r
            self._alive.append(r)
        r.slots, r.seats, r.alive = slots, seats, True
        self.touch(r)
        return r

    def remove(self, replica_id: str) -> ReplicaState | None:
        """Forget the replica; the caller orphans what it held (`r.assigned`)."""
        r = self.replicas.pop(replica_id, None)
        if r is None:
            return None
        r.alive = False
        self._roomy = None
        self.queueing.discard(r)
        r.version += 1
        for h in r.hashes:
            holders = self.hash_index.get(h)
            if holders is not None:
                holders.discard(replica_id)
                if not holders:
                    del self.hash_index[h]
        self._alive = [x for x in self._alive if x is not r]
        return r

    def touch(self, r: ReplicaState) -> None:
        """Re-index r in the load heap after its load changed."""
        r.version += 1
        self._roomy = None
        if r.alive and len(r.assigned) > r.seats:
            self.queueing.add(r)
        else:
            self.queueing.discard(r)
        if r.alive:
            heapq.heappush(self._heap, (r.load, r.index, r.version, r))
            if len(self._heap) > 4 * len(self.replicas) + 64:
                self._heap = [(x.load, x.index, x.version, x) for x in self.replicas.values()]
                heapq.heapify(self._heap)

    def set_hashes(self, r: ReplicaState, hashes: Iterable[bytes]) -> None:
        """r's cached prefixes, as its report lists them (`report_hashes`)."""
        device, host = split_hashes(hashes)
        new = device | host
        r.host_hashes = host
        index = self.hash_index
        for h in r.hashes - new:
            holders = index.get(h)
            if holders is not None:
                holders.discard(r.replica_id)
                if not holders:
                    del index[h]
        for h in new - r.hashes:
            index.setdefault(h, set()).add(r.replica_id)
        r.hashes = new
        self._roomy = None  # also drops the memoized hit lengths, which read r's cache

    # ---- choosing ---------------------------------------------------------------------------

    def least_loaded(self) -> ReplicaState | None:
        heap = self._heap
        while heap:
            load, _, version, r = heap[0]
            if version == r.version and r.alive:
                return r
            heapq.heappop(heap)
        return None

    def least_loaded_except(self, replica_id: str) -> ReplicaState | None:
        alive = [r for r in self.replicas.values() if r.alive and r.replica_id != replica_id]
        return min(alive, key=lambda r: (r.load, r.index), default=None)

    def pick(self, t: Ticket) -> ReplicaState | None:
        """A replica with room for `t` ("fair" or "d2lpm" routing), or None."""
        if self.routing == "d2lpm":
            return self.pick_d2lpm(t)
        least = self.least_loaded()
        if least is None or not least.has_room():
            return None
        meta = t.meta
        if meta is not None and meta.prefix_hashes and self.hash_index:
            # Longest cached prefix first; a few holders per block keep this O(blocks).
            for h in reversed(meta.prefix_hashes):
                holders = self.hash_index.get(h)
                if not holders:
                    continue
                best = None
                for rid in itertools.islice(holders, AFFINITY_PROBES):
                    r = self.replicas.get(rid)
                    if r is None or not r.takes_for_locality(least.load):
                        continue
                    if best is None or r.load < best.load:
                        best = r
                if best is not None:
                    return best
        lora = None if meta is None else meta.params.lora
        if lora is not None and lora.name not in least.loras:
            # no cached prefix: a replica holding its adapter, on the same terms as a cache
            # hit (no load to wait for); else the least loaded one loads it
            held = [
                r
                for r in self.replicas.values()
                if lora.name in r.loras and r.takes_for_locality(least.load)
            ]
            if held:
                return min(held, key=lambda r: (r.load, r.index))
        return least

    def steals(self) -> Iterator[tuple[Ticket, ReplicaState, ReplicaState]]:
        """(ticket, src, dst): a request waiting in src's local queue (as src last reported it)
        to move to dst, the least loaded replica, which has a free seat; one at a time, the
        caller moves each before asking for the next (the loads change). The most loaded
        queue gives first, its latest assignment: the one that would wait longest there."""
        while self.queueing:
            dst = self.least_loaded()
            if dst is None or dst.load >= dst.seats:
                return
            found = None
            for src in sorted(self.queueing, key=lambda r: (r.seats - r.load, r.index)):
                waiting = [
                    t for t in src.assigned.values() if t.seen and not (t.running or t.preempted)
                ]
                if waiting:
                    found = max(waiting, key=lambda t: t.assigned_at), src
                    break
            if found is None:
                return
            yield found[0], found[1], dst

    def match_blocks(self, r: ReplicaState, hashes: list[bytes]) -> int:
        """How many leading blocks of `hashes` r caches."""
        n = 0
        cached = r.hashes
        while n < len(hashes) and hashes[n] in cached:
            n += 1
        return n

    def cached_prefix_tokens(self, t: Ticket) -> int:
        """Prompt tokens of `t` cached on a replica it could be sent to for that now
        (`takes_for_locality`): the longest leading run of blocks one such replica holds. The
        hit length the controller's dlpm / lpm order reads. A prefix cached only on full
        replicas counts for nothing: under load `t` would go elsewhere and miss (an order by
        hits "anywhere" ranks nearly every request of a hot prompt alike and buys no
        locality)."""
        hashes = t.meta.prefix_hashes if t.meta is not None else None
        if not hashes:
            return 0
        if self._roomy is None:
            least = self.least_loaded()
            lowest = least.load if least is not None else 0
            self._roomy = [r for r in self.replicas.values() if r.takes_for_locality(lowest)]
            self._hits = {}
        # dlpm's order asks this for every queued request at every pick, and most of them
        # share a few system prompts: one match per distinct prefix until a load or a cache
        # changes, not one per request (block hashes are chained, so the last names them all)
        n = self._hits.get(hashes[-1])
        if n is None:
            n = self._hits[hashes[-1]] = self._match_on_roomy(hashes)
        return n

    def _match_on_roomy(self, hashes: list[bytes]) -> int:
        cands = [r for r in self._roomy or () if hashes[0] in r.hashes]
        if not cands:
            return 0
        block_size, n = cands[0].block_size, 1
        while n < len(hashes):
            cands = [r for r in cands if hashes[n] in r.hashes]
            if not cands:
                break
            n += 1
        return n * block_size

    def pick_d2lpm(self, t: Ticket) -> ReplicaState | None:
        """d2lpm: the longest match among the replicas locality may use, else the least
        loaded. Sets `t.locality` to the deficit it takes when the match decided."""
        t.locality = 0.0
        least = self.least_loaded()
        if least is None or not least.has_room():
            return None
        hashes = t.meta.prefix_hashes if t.meta is not None else []
        if not hashes:
            return least
        loc = self.locality
        need = max(1, math.ceil(loc.min_match * len(hashes)))
        if need > len(hashes):
            return least
        cost = loc.cost(t)
        allowance = loc.allowance(t.tenant)
        best, best_key = None, None
        for rid in self.hash_index.get(hashes[need - 1], ()):
            r = self.replicas.get(rid)
            if r is None or not r.has_room() or r.load > least.load + loc.load_slack:
                continue
            if r.locality.get(t.tenant, 0.0) + cost > allowance:
                continue  # no deficit left for this tenant here
            n = self.match_blocks(r, hashes)
            if n < need:
                continue
            on_host = sum(1 for h in hashes[:n] if h in r.host_hashes) if r.host_hashes else 0
            key = (-(n - (1 - loc.host_hit_weight) * on_host), r.load, r.index)
            if best_key is None or key < best_key:
                best, best_key = r, key
        if best is None:
            return least
        t.locality = cost
        return best

    def charge_locality(self, t: Ticket, r: ReplicaState) -> None:
        """`t` was placed on r for its match: its cost comes off its tenant's deficit there."""
        if t.locality:
            r.locality[t.tenant] = r.locality.get(t.tenant, 0.0) + t.locality

    def release_locality(self, t: Ticket, r: ReplicaState | None) -> None:
        """`t` ended on r or left it: its tenant's deficit there grows back."""
        if t.locality and r is not None:
            left = r.locality.get(t.tenant, 0.0) - t.locality
            if left > 1e-9:
                r.locality[t.tenant] = left
            else:
                r.locality.pop(t.tenant, None)
        t.locality = 0.0

    def route_baseline(self, t: Ticket | None = None) -> ReplicaState | None:
        """The baselines: round robin, the less loaded of two at random, or the longest cached
        prefix of `t` (then the least loaded). No slot limit."""
        alive = self._alive
        if not alive:
            return None
        if self.routing == "prefix_affinity":
            hashes = t.meta.prefix_hashes if t is not None and t.meta is not None else []
            best, best_key = None, None
            for rid in self.hash_index.get(hashes[0], ()) if hashes else ():
                r = self.replicas.get(rid)
                if r is not None and r.alive:
                    key = (-self.match_blocks(r, hashes), r.load, r.index)
                    if best_key is None or key < best_key:
                        best, best_key = r, key
            return best or self.least_loaded()
        if self.routing == "round_robin":
            self._rr += 1
            return alive[self._rr % len(alive)]
        a, b = self.rng.sample(alive, 2) if len(alive) > 1 else (alive[0], alive[0])
        return a if a.load <= b.load else b
