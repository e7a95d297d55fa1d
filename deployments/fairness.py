"""The fairness controller's logic, without Ray: who is admitted next, where, and who gives way.

`FairnessCore` is driven by three events - a request is submitted, a replica reports, a request
is cancelled - and answers each with actions (`Assign`, `Preempt`, `Migrate`) for its caller to
carry out. The Ray actor (`controller.py`) and the cluster benchmark (no Ray) both drive it.

Routing modes:
  * "fair" (fairbatch): one global queue ordered by a `fairbatch.policies` policy over
    cluster-wide virtual counters; a request leaves it only when some replica has a free slot
    (running seats + a short local queue), preferring the replica that caches the longest
    prefix of its prompt, then the least loaded one.
  * "round_robin", "power_of_two" (baselines): no global queue, every request is routed at once
    and waits in its replica's local queue, ordered by that replica's own policy.

Cost per admission: O(log R) for the replica choice (a heap of loads with lazy deletion), plus
O(log n) queue work; prefix affinity looks at <= `AFFINITY_PROBES` holders per prompt block.
Counters: a request's prompt is charged when it is admitted (so a burst of admissions between
two reports cannot all go to one tenant); decode tokens are charged from the reports.
"""

from __future__ import annotations

import heapq
import itertools
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from fairbatch.deployments.types import RequestMeta
from fairbatch.policies import TenantSpec, make_policy

ROUTINGS = ("fair", "round_robin", "power_of_two")
AFFINITY_PROBES = 4  # replicas looked at per prompt block when matching prefixes


@dataclass
class ControllerConfig:
    routing: str = "fair"
    policy: str = "priority"  # global order in "fair" mode (priority: weighted fair inside)
    policy_kwargs: dict = field(default_factory=dict)
    tenants: list[TenantSpec] = field(default_factory=list)
    local_queue: int = 2  # requests a replica may hold beyond its running seats ("fair")
    preemption: bool = True  # coordinated preemption for higher-priority waiting requests
    preempt_mode: str = "auto"  # "auto" | "swap" | "recompute"
    migrate_displaced: bool = True  # move a preempted request to a replica with room
    input_weight: float = 1.0
    output_weight: float = 2.0
    stale_assignment_s: float = 30.0  # assigned but never seen by its replica: dropped after

    def __post_init__(self) -> None:
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {self.routing!r}")
        if self.local_queue < 0:
            raise ValueError(f"local_queue must be >= 0, got {self.local_queue}")


class Ticket:
    """A request as the controller's queues see it (duck-types what policies read)."""

    __slots__ = (
        "request_id",
        "tenant",
        "priority",
        "seq",
        "arrival_time",
        "meta",
        "replica",
        "assigned_at",
        "seen",
        "running",
        "preempted",
        "max_tokens",
    )

    def __init__(self, meta: RequestMeta | None, request_id: str, tenant: str, priority: int):
        self.request_id = request_id
        self.tenant = tenant
        self.priority = priority
        self.seq = 0
        self.arrival_time = time.monotonic()
        self.meta = meta
        self.replica: str | None = None
        self.assigned_at = 0.0
        self.seen = False  # its replica reported holding it
        self.running = False  # holding GPU blocks, as of the last report
        self.preempted = False  # displaced by coordinated preemption, not yet running again
        self.max_tokens = 0 if meta is None else meta.params.max_tokens  # decode tokens prepaid


@dataclass
class Assign:
    ticket: Ticket
    replica_id: str


@dataclass
class Preempt:
    replica_id: str
    request_id: str
    mode: str


@dataclass
class Migrate:
    request_id: str
    src: str
    dst: str


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


class FairnessCore:
    def __init__(
        self,
        config: ControllerConfig,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.rng = rng or random.Random(0)
        kw = dict(config.policy_kwargs)
        if config.policy == "priority":
            kw.setdefault("inner", "weighted_fair")
        self.policy = make_policy(
            config.policy,
            config.tenants,
            input_weight=config.input_weight,
            output_weight=config.output_weight,
            **kw,
        )
        self.replicas: dict[str, ReplicaState] = {}
        self._heap: list[tuple[int, int, int, ReplicaState]] = []  # (load, index, version, r)
        self._indices = itertools.count()
        self._rr = 0
        self._alive: list[ReplicaState] = []  # registration order (baseline routing)
        self._seq = itertools.count(1)
        self.tickets: dict[str, Ticket] = {}  # queued or assigned
        self._displaced: dict[str, Ticket] = {}  # preempted by the controller, not yet resumed
        self._hash_index: dict[bytes, set[str]] = {}  # prefix block hash -> replicas caching it
        self._queued: dict[str, int] = {}  # tenant -> requests in the global queue
        self._by_priority: dict[int, dict[str, Ticket]] = {}  # assigned tickets per priority
        self.num_admitted = 0
        self.num_preemptions = 0
        self.num_migrations = 0
        self.max_counter_diff = 0.0  # largest counter spread among backlogged tenants seen

    # ---- replicas ---------------------------------------------------------------------------

    def add_replica(self, replica_id: str, max_num_seqs: int) -> ReplicaState:
        r = self.replicas.get(replica_id)
        slots = max_num_seqs + (self.config.local_queue if self.config.routing == "fair" else 0)
        if r is None:
            r = self.replicas[replica_id] = ReplicaState(replica_id, next(self._indices), slots)
            self._alive.append(r)
        r.slots, r.alive = slots, True
        self._touch(r)
        return r

    def remove_replica(self, replica_id: str) -> list[Ticket]:
        """The replica died: forget it and return the tickets it held (their clients resubmit)."""
        r = self.replicas.pop(replica_id, None)
        if r is None:
            return []
        r.alive = False
        r.version += 1
        for h in r.hashes:
            holders = self._hash_index.get(h)
            if holders is not None:
                holders.discard(replica_id)
                if not holders:
                    del self._hash_index[h]
        orphans = list(r.assigned.values())
        for t in orphans:
            self._unassigned(t)
            self._forget(t)
        self._alive = [x for x in self._alive if x is not r]
        return orphans

    def _touch(self, r: ReplicaState) -> None:
        """Re-index r in the load heap after its load changed."""
        r.version += 1
        if r.alive:
            heapq.heappush(self._heap, (r.load, r.index, r.version, r))
            if len(self._heap) > 4 * len(self.replicas) + 64:
                self._heap = [(x.load, x.index, x.version, x) for x in self.replicas.values()]
                heapq.heapify(self._heap)

    def _least_loaded(self) -> ReplicaState | None:
        heap = self._heap
        while heap:
            load, _, version, r = heap[0]
            if version == r.version and r.alive:
                return r
            heapq.heappop(heap)
        return None

    # ---- requests ---------------------------------------------------------------------------

    def submit(self, meta: RequestMeta) -> list:
        """Queue (or, for baselines, route) a request. Returns actions."""
        rid = meta.request_id
        if rid in self.tickets:
            raise ValueError(f"duplicate request id {rid!r}")
        t = Ticket(meta, rid, meta.tenant, meta.priority)
        t.seq = next(self._seq)
        self.tickets[rid] = t
        if self.config.routing != "fair":
            r = self._route_baseline()
            if r is None:
                self._enqueue(t)  # no replica yet: wait for one to report
                return []
            return [self._assign(t, r)]
        self._enqueue(t)
        return self.dispatch()

    def _enqueue(self, t: Ticket) -> None:
        self.policy.enqueue(t)
        self._queued[t.tenant] = self._queued.get(t.tenant, 0) + 1

    def _pop(self) -> Ticket:
        t = self.policy.pop()
        self._unqueued(t)
        return t

    def _unqueued(self, t: Ticket) -> None:
        n = self._queued[t.tenant] - 1
        if n:
            self._queued[t.tenant] = n
        else:
            del self._queued[t.tenant]

    def cancel(self, request_id: str) -> None:
        """The client gave up. A queued request leaves the queue; one its replica holds stays
        until the replica reports it ended (the client aborts it there), so the refund of its
        unused output happens then."""
        t = self.tickets.get(request_id)
        if t is None:
            return
        if t.replica is None:
            if self.policy.remove(t):
                self._unqueued(t)
            self._forget(t)
        elif not t.seen:  # never reached its replica
            self._forget(t)
            self._refund(t, 0, never_ran=True)

    def _forget(self, t: Ticket) -> None:
        self.tickets.pop(t.request_id, None)
        self._displaced.pop(t.request_id, None)
        if t.replica is not None:
            r = self.replicas.get(t.replica)
            if r is not None and r.assigned.pop(t.request_id, None) is not None:
                self._unassigned(t)
                self._touch(r)

    def where(self, request_id: str) -> str | None:
        t = self.tickets.get(request_id)
        return None if t is None else t.replica

    # ---- dispatch ---------------------------------------------------------------------------

    def dispatch(self) -> list:
        """Hand out free slots: displaced requests first, then the global queue in fair order."""
        actions: list = []
        if self.config.routing != "fair":
            while len(self.policy) and (r := self._route_baseline()) is not None:
                actions.append(self._assign(self._pop(), r))
            return actions
        if self._displaced and self.config.migrate_displaced:
            self._migrate_displaced(actions)
        policy = self.policy
        while True:
            t = policy.peek()
            if t is None:
                break
            r = self._pick_replica(t)
            if r is None:
                if self.config.preemption:
                    self._preempt_for(t, actions)
                break
            self._pop()
            actions.append(self._assign(t, r))
        return actions

    def _assign(self, t: Ticket, r: ReplicaState) -> Assign:
        t.replica = r.replica_id
        t.assigned_at = self.clock()
        r.assigned[t.request_id] = t
        self._assigned(t)
        self._touch(r)
        self.num_admitted += 1
        if t.meta is not None and t.meta.attempt == 0:
            # Prepaid: the prompt and max_tokens of output are charged now, and what was not
            # generated is refunded when the request ends. Charging only what replicas report
            # lets a burst of admissions between two reports (or one wave of equal requests)
            # swing the counters by a batch's worth; prepaying makes each slot's allocation see
            # the work already committed. (A resubmission was prepaid by its first attempt.)
            self.policy.charge(t.tenant, t.meta.num_prompt_tokens, t.max_tokens)
        return Assign(t, r.replica_id)

    def _pick_replica(self, t: Ticket) -> ReplicaState | None:
        meta = t.meta
        if meta is not None and meta.prefix_hashes and self._hash_index:
            # Longest cached prefix first; a few holders per block keep this O(blocks).
            for h in reversed(meta.prefix_hashes):
                holders = self._hash_index.get(h)
                if not holders:
                    continue
                best = None
                for rid in itertools.islice(holders, AFFINITY_PROBES):
                    r = self.replicas.get(rid)
                    if r is not None and r.has_room() and (best is None or r.load < best.load):
                        best = r
                if best is not None:
                    return best
        r = self._least_loaded()
        return r if r is not None and r.has_room() else None

    def _route_baseline(self) -> ReplicaState | None:
        alive = self._alive
        if not alive:
            return None
        if self.config.routing == "round_robin":
            self._rr += 1
            return alive[self._rr % len(alive)]
        a, b = self.rng.sample(alive, 2) if len(alive) > 1 else (alive[0], alive[0])
        return a if a.load <= b.load else b

    # ---- coordinated preemption and migration -----------------------------------------------

    def _preempt_for(self, t: Ticket, actions: list) -> None:
        """No slot anywhere and `t` waits: if some running request has a lower priority, preempt
        the cluster-wide victim (lowest priority, most over-served tenant, latest) and give its
        slot to `t` on that replica (the replica's local scheduler runs `t` first)."""
        victim = self._pick_victim(t.priority)
        if victim is None:
            return
        r = self.replicas[victim.replica]  # type: ignore[index]
        victim.preempted, victim.running = True, False
        self._displaced[victim.request_id] = victim
        self.num_preemptions += 1
        self._pop()
        actions.append(Preempt(r.replica_id, victim.request_id, self.config.preempt_mode))
        actions.append(self._assign(t, r))

    def _assigned(self, t: Ticket) -> None:
        level = self._by_priority.get(t.priority)
        if level is None:
            level = self._by_priority[t.priority] = {}
        level[t.request_id] = t

    def _unassigned(self, t: Ticket) -> None:
        level = self._by_priority.get(t.priority)
        if level is not None:
            level.pop(t.request_id, None)
            if not level:
                del self._by_priority[t.priority]

    def _pick_victim(self, below: int) -> Ticket | None:
        # O(priority classes) when nothing of lower priority runs (the common case: a waiting
        # request of the lowest class); otherwise a scan of the lowest class only, which runs
        # when a preemption is due, not per admission.
        lower = [p for p in self._by_priority if p < below]
        if not lower:
            return None
        counters = self.policy._counters
        best, best_key = None, None
        for p in sorted(lower):
            for t in self._by_priority[p].values():
                if t.preempted or not t.seen:
                    continue
                # A waiting victim frees no seat: prefer running ones within the class.
                key = (not t.running, -counters.get(t.tenant, 0.0), -t.seq)
                if best_key is None or key < best_key:
                    best, best_key = t, key
            if best is not None:
                return best
        return None

    def _migrate_displaced(self, actions: list) -> None:
        for rid, t in list(self._displaced.items()):
            src = self.replicas.get(t.replica or "")
            dst = self._least_loaded()
            if src is None or dst is None or not dst.has_room() or dst is src:
                return
            if src.load <= src.slots:
                continue  # room came back at home: it resumes there
            del self._displaced[rid]
            t.preempted = False
            del src.assigned[rid]
            self._touch(src)
            t.replica = dst.replica_id
            dst.assigned[rid] = t
            self._touch(dst)
            self.num_migrations += 1
            actions.append(Migrate(rid, src.replica_id, dst.replica_id))

    def migrate(self, request_id: str, dst_id: str | None = None) -> Migrate | None:
        """Move a request to another replica (the least loaded one unless `dst_id`)."""
        t = self.tickets.get(request_id)
        if t is None or t.replica is None:
            return None
        src = self.replicas.get(t.replica)
        dst = self.replicas.get(dst_id) if dst_id else self._least_loaded_except(t.replica)
        if src is None or dst is None or dst is src:
            return None
        del src.assigned[request_id]
        self._touch(src)
        t.replica = dst.replica_id
        dst.assigned[request_id] = t
        self._touch(dst)
        self.num_migrations += 1
        return Migrate(request_id, src.replica_id, dst.replica_id)

    def _least_loaded_except(self, replica_id: str) -> ReplicaState | None:
        alive = [r for r in self.replicas.values() if r.alive and r.replica_id != replica_id]
        return min(alive, key=lambda r: (r.load, r.index), default=None)

    # ---- reports ----------------------------------------------------------------------------

    def report(self, rep) -> list:
        """Fold a replica's report in; returns the actions the freed slots allow."""
        r = self.replicas.get(rep.replica_id)
        if r is None or not r.synced:
            r = self.add_replica(rep.replica_id, rep.max_num_seqs)
        if rep.seq <= r.last_seq:
            return []
        r.last_seq = rep.seq
        r.free_blocks, r.total_blocks, r.block_size = (
            rep.free_blocks,
            rep.total_blocks,
            rep.block_size,
        )
        self._charge(r, rep.service)
        changed = False
        for rid, num_out in rep.finished:
            t = r.assigned.pop(rid, None)  # None when it moved away from this replica
            if t is not None:
                self._unassigned(t)
                self.tickets.pop(rid, None)
                self._displaced.pop(rid, None)
                self._refund(t, num_out)
                changed = True
        if not r.synced:
            changed |= self._adopt(r, rep.active)
            r.synced = True
        now = self.clock()
        for rid, t in list(r.assigned.items()):
            state = rep.active.get(rid)
            if state is not None:
                t.seen, t.running = True, state[2]
                if t.preempted and t.running:
                    t.preempted = False  # resumed where it was
                    self._displaced.pop(rid, None)
            elif not t.seen and now - t.assigned_at > self.config.stale_assignment_s:
                self._forget(t)  # its client never reached the replica
                self._refund(t, 0, never_ran=True)
                changed = True
        if rep.prefix_hashes is not None:
            self._set_hashes(r, rep.prefix_hashes)
        if changed:
            self._touch(r)
        self._track_spread()
        return self.dispatch()

    def _refund(self, t: Ticket, num_out: int, never_ran: bool = False) -> None:
        """Give back the prepaid output not generated (and the prompt, if it never ran)."""
        unused = max(0, t.max_tokens - num_out)
        prompt = t.meta.num_prompt_tokens if never_ran and t.meta and not t.meta.attempt else 0
        if unused or prompt:
            self.policy.charge(t.tenant, -prompt, -unused)

    def _charge(self, r: ReplicaState, service: dict[str, tuple[int, int]]) -> None:
        # Admissions prepay, so reported service is charged only once per replica and
        # controller incarnation: the first report after a (re)start brings back what the
        # replica served before this controller existed.
        if not r.synced:
            for tenant, (prefill, decode) in service.items():
                if prefill or decode:
                    self.policy.charge(tenant, prefill, decode)
        r.service = dict(service)

    def _adopt(self, r: ReplicaState, active: dict[str, tuple[str, int, bool, int, int]]) -> bool:
        """Rebuild the assignments of a replica this controller has not heard from before;
        their remaining output is prepaid like a new admission's."""
        changed = False
        for rid, (tenant, priority, running, max_tokens, num_out) in active.items():
            if rid in self.tickets:
                continue
            t = Ticket(None, rid, tenant, priority)
            t.seq = next(self._seq)
            t.replica, t.seen, t.assigned_at = r.replica_id, True, self.clock()
            t.running, t.max_tokens = running, max_tokens
            if max_tokens > num_out:
                self.policy.charge(tenant, 0, max_tokens - num_out)
            self.tickets[rid] = t
            r.assigned[rid] = t
            self._assigned(t)
            changed = True
        return changed

    def _set_hashes(self, r: ReplicaState, hashes: Iterable[bytes]) -> None:
        new = set(hashes)
        index = self._hash_index
        for h in r.hashes - new:
            holders = index.get(h)
            if holders is not None:
                holders.discard(r.replica_id)
                if not holders:
                    del index[h]
        for h in new - r.hashes:
            index.setdefault(h, set()).add(r.replica_id)
        r.hashes = new

    # ---- fairness metrics -------------------------------------------------------------------

    def _track_spread(self) -> None:
        if len(self._queued) < 2:
            return
        counters = self.policy._counters
        values = [counters[name] for name in self._queued]
        self.max_counter_diff = max(self.max_counter_diff, max(values) - min(values))

    def counters(self) -> dict[str, float]:
        return self.policy.counters()

    def stats(self) -> dict:
        return {
            "queued": len(self.policy),
            "assigned": {r.replica_id: r.load for r in self.replicas.values()},
            "admitted": self.num_admitted,
            "preemptions": self.num_preemptions,
            "migrations": self.num_migrations,
            "counters": self.counters(),
            "service": self.policy.service(),
            "max_counter_diff": self.max_counter_diff,
        }
