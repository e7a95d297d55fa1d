"""Where a request goes: the controller's replica table, their loads, and the prefix index.

`Placement` is part of `FairnessCore` (fairness.py), plain Python. In "fair" routing, `pick`
prefers the replica caching the longest prefix of the prompt (at most `AFFINITY_PROBES`
holders looked at per prompt block), then the least loaded one: loads live in a heap with lazy
deletion (an entry whose version is stale is skipped), so a pick is O(log R), no scan. The
baselines ("round_robin", "power_of_two") route over the replicas in registration order.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Iterable

from fairbatch.deployments.cluster.tickets import Ticket

AFFINITY_PROBES = 4  # replicas looked at per prompt block when matching prefixes


class ReplicaState:
    __slots__ = (
        "replica_id",
        "index",
        "slots",
        "assigned",
        "alive",
        "free_blocks",
        "total_blocks",
        "block_size",
        "service",
        "hashes",
        "last_seq",
        "version",
        "synced",
    )

    def __init__(self, replica_id: str, index: int, slots: int) -> None:
        self.replica_id = replica_id
        self.index = index
        self.slots = slots  # running seats + local queue
        self.assigned: dict[str, Ticket] = {}
        self.alive = True
        self.free_blocks = 0
        self.total_blocks = 0
        self.block_size = 16
        self.service: dict[str, tuple[int, int]] = {}  # last cumulative report
        self.hashes: set[bytes] = set()
        self.last_seq = -1
        self.version = 0  # heap entries with another version are stale
        self.synced = False  # has this controller seen a report from it yet

    @property
    def load(self) -> int:
        return len(self.assigned)

    def has_room(self) -> bool:
        return self.alive and len(self.assigned) < self.slots


class Placement:
    def __init__(self, routing: str, rng: random.Random) -> None:
        self.routing = routing
        self.rng = rng
        self.replicas: dict[str, ReplicaState] = {}
        self._heap: list[tuple[int, int, int, ReplicaState]] = []  # (load, index, version, r)
        self._indices = itertools.count()
        self._rr = 0
        self._alive: list[ReplicaState] = []  # registration order (baseline routing)
        self.hash_index: dict[bytes, set[str]] = {}  # prefix block hash -> replicas caching it

    # ---- the replica table ------------------------------------------------------------------

    def add(self, replica_id: str, slots: int) -> ReplicaState:
        r = self.replicas.get(replica_id)
        if r is None:
            r = self.replicas[replica_id] = ReplicaState(replica_id, next(self._indices), slots)
            self._alive.append(r)
        r.slots, r.alive = slots, True
        self.touch(r)
        return r

    def remove(self, replica_id: str) -> ReplicaState | None:
        """Forget the replica; the caller orphans what it held (`r.assigned`)."""
        r = self.replicas.pop(replica_id, None)
        if r is None:
            return None
        r.alive = False
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
        if r.alive:
            heapq.heappush(self._heap, (r.load, r.index, r.version, r))
            if len(self._heap) > 4 * len(self.replicas) + 64:
                self._heap = [(x.load, x.index, x.version, x) for x in self.replicas.values()]
                heapq.heapify(self._heap)

    def set_hashes(self, r: ReplicaState, hashes: Iterable[bytes]) -> None:
        new = set(hashes)
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
        """A replica with room for `t` ("fair" routing), or None."""
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
                    if r is not None and r.has_room() and (best is None or r.load < best.load):
                        best = r
                if best is not None:
                    return best
        r = self.least_loaded()
        return r if r is not None and r.has_room() else None

    def route_baseline(self) -> ReplicaState | None:
        """The baselines: round robin, or the less loaded of two at random. No slot limit."""
        alive = self._alive
        if not alive:
            return None
        if self.routing == "round_robin":
            self._rr += 1
            return alive[self._rr % len(alive)]
        a, b = self.rng.sample(alive, 2) if len(alive) > 1 else (alive[0], alive[0])
        return a if a.load <= b.load else b
