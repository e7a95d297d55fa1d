"""The fairness controller's logic, without Ray: who is admitted next, where, and who gives way.

`FairnessCore` is driven by three events - a request is submitted, a replica reports, a request
is cancelled - and answers each with actions (`Assign`, `Preempt`, `Migrate`) for its caller to
carry out. The Ray actor (`controller.py`) and the cluster benchmark (no Ray) both drive it.
This module is the global queue (admission) and the accounting (prepaid counters, refunds,
rebuilding from reports); where a request goes is `placement.py`, who gives way and where a
displaced request moves is `preemption.py`, the config, tickets and actions are `tickets.py`
(all re-exported here).

Routing modes:
  * "fair" (fairbatch): one global queue ordered by a `fairbatch.policies` policy over
    cluster-wide virtual counters; a request leaves it only when some replica has a free slot
    (running seats + a short local queue), preferring the replica that caches the longest
    prefix of its prompt, then the least loaded one. A request sent ahead into one replica's
    local queue moves to a seat that frees on another while the global queue is empty
    (`rebalance_local_queues`; a `Migrate` the source refuses once the request has started).
  * "d2lpm": the same global queue; the replica is chosen for its prefix match within a
    per-replica, per-tenant deficit and a load slack (placement.py). With policy dlpm (or lpm)
    the queue's hit lengths are the longest prefix a replica with room caches (in any routing).
  * "round_robin", "power_of_two", "prefix_affinity" (baselines): no global queue, every request
    is routed at once and waits in its replica's local queue, ordered by that replica's policy.

Cost per admission: O(log R) for the replica choice (a heap of loads with lazy deletion), plus
O(log n) queue work; prefix affinity looks at <= `AFFINITY_PROBES` holders per prompt block.
Under dlpm / lpm a pick reads the hit length of every queued request: a dict lookup each, the
prefix match itself done once per distinct prefix until a load or a cache changes (placement.py).
Counters: a request's prompt and `max_tokens` of output are charged when it is admitted (so a
burst of admissions between two reports cannot all go to one tenant); what it did not generate
is refunded when its replica reports it ended.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from collections.abc import Callable

from fairbatch.deployments.cluster.limits import ClusterLimits, LimitsSpec
from fairbatch.deployments.cluster.placement import (
    AFFINITY_PROBES,
    Locality,
    Placement,
    ReplicaState,
)
from fairbatch.deployments.cluster.preemption import Preemption
from fairbatch.deployments.cluster.tickets import (
    QUEUED_ROUTINGS,
    ROUTINGS,
    Assign,
    ControllerConfig,
    Expire,
    Migrate,
    Preempt,
    Refuse,
    Ticket,
)
from fairbatch.deployments.cluster.wire import RequestMeta
from fairbatch.policies import make_policy

__all__ = [
    "AFFINITY_PROBES",
    "ROUTINGS",
    "Assign",
    "ControllerConfig",
    "Expire",
    "FairnessCore",
    "Migrate",
    "Preempt",
    "Refuse",
    "ReplicaState",
    "Ticket",
]


class FairnessCore:
    def __init__(
        self,
        config: ControllerConfig,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.clock = clock
        self.wall = wall  # the clock of RequestMeta's deadlines (wall-clock time)
        self._expiring: list[tuple[float, int, Ticket]] = []  # queued tickets with a deadline
        self.timed_out: dict[str, int] = {}  # tenant -> tickets dropped past a deadline
        self.rng = rng or random.Random(0)
        self.policy = make_policy(
            config.policy,
            config.tenants,
            input_weight=config.input_weight,
            output_weight=config.output_weight,
            **config.policy_kwargs,
        )
        locality = Locality(
            config.d2lpm_quantum,
            config.d2lpm_min_match,
            config.d2lpm_load_slack,
            config.input_weight,
            config.output_weight,
            {spec.name: spec.weight for spec in config.tenants},
        )
        self.placement = Placement(config.routing, self.rng, locality)
        if self.policy.wants_hit_length:  # over the cluster: hits = prefixes replicas cache
            self.policy.set_hit_length(self.placement.cached_prefix_tokens)
        self._queued_routing = config.routing in QUEUED_ROUTINGS
        self.replicas = self.placement.replicas  # replica id -> ReplicaState
        self.preemption = Preemption()
        self.limits = None if config.limits is None else ClusterLimits(config.limits, clock)
        self._seq = itertools.count(1)
        self.tickets: dict[str, Ticket] = {}  # queued or assigned
        self._queued: dict[str, int] = {}  # tenant -> requests in the global queue
        self.num_admitted = 0
        self.num_preemptions = 0
        self.num_migrations = 0
        self.max_counter_diff = 0.0  # largest counter spread among backlogged tenants seen
        # Moves under way: request id -> the replica it leaves, and, when that replica reported
        # it gone meanwhile, the output it left with (a move's end, or a finish if refused)
        self._moving: dict[str, str] = {}
        self._left_while_moving: dict[str, int] = {}

    # ---- replicas ---------------------------------------------------------------------------

    def add_replica(self, replica_id: str, max_num_seqs: int) -> ReplicaState:
        local_queue = self.config.local_queue if self._queued_routing else 0
        return self.placement.add(replica_id, max_num_seqs, local_queue)

    def remove_replica(self, replica_id: str) -> list[Ticket]:
        """The replica died: forget it and return the tickets it held (their clients resubmit)."""
        r = self.placement.remove(replica_id)
        if r is None:
            return []
        orphans = list(r.assigned.values())
        for t in orphans:
            self.placement.release_locality(t, r)
            self.preemption.unassigned(t)
            self._forget(t)
        return orphans

    # ---- requests ---------------------------------------------------------------------------

    def submit(self, meta: RequestMeta) -> list:
        """Queue (or, for baselines, route) a request. Returns actions."""
        rid = meta.request_id
        if rid in self.tickets:
            raise ValueError(f"duplicate request id {rid!r}")
        if self.limits is not None:
            if meta.attempt:  # admitted before, resubmitted: never refused now
                self.limits.started(meta.tenant)
            else:
                refused = self.limits.admit(meta.tenant, meta.num_charged_prompt_tokens)
                if refused is not None:
                    return [Refuse(rid, refused)]
        t = Ticket(meta, rid, meta.tenant, meta.priority)
        t.counted = self.limits is not None
        t.charged_out = len(meta.output_ids)  # a resubmission's earlier output: charged before
        t.seq = next(self._seq)
        self.tickets[rid] = t
        self._watch_deadline(t)
        if not self._queued_routing:
            r = self.placement.route_baseline(t)
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
        self._untrack(t)
        self.preemption.displaced.pop(t.request_id, None)
        if t.replica is not None:
            r = self.replicas.get(t.replica)
            if r is not None and r.assigned.pop(t.request_id, None) is not None:
                self.placement.release_locality(t, r)
                self.preemption.unassigned(t)
                self.placement.touch(r)

    def where(self, request_id: str) -> str | None:
        t = self.tickets.get(request_id)
        return None if t is None else t.replica

    # ---- deadlines --------------------------------------------------------------------------

    def _watch_deadline(self, t: Ticket) -> None:
        """Take the request's wall-clock deadlines into this core's clock (before it is queued:
        under order_within_tenant=edf the policy orders by them)."""
        meta = t.meta
        offset = self.clock() - self.wall()
        if meta.deadline is not None:
            t.deadline = meta.deadline + offset
        if meta.queue_deadline is not None:
            t.queue_deadline = meta.queue_deadline + offset
        when = min(t.deadline, t.queue_deadline)
        if when != math.inf:
            heapq.heappush(self._expiring, (when, t.seq, t))

    def expire(self) -> list[Expire]:
        """Drop the queued tickets past their deadline (the caller tells their clients). An
        assigned one is its replica's to end: replicas enforce deadlines themselves."""
        expired: list[Expire] = []
        heap = self._expiring
        now = self.clock() if heap else 0.0
        while heap and heap[0][0] <= now:
            t = heapq.heappop(heap)[2]
            if self.tickets.get(t.request_id) is not t or t.replica is not None:
                continue  # gone, or assigned
            if self.policy.remove(t):
                self._unqueued(t)
            self._forget(t)
            self.timed_out[t.tenant] = self.timed_out.get(t.tenant, 0) + 1
            expired.append(Expire(t))
        return expired

    # ---- dispatch ---------------------------------------------------------------------------

    def dispatch(self) -> list:
        """Hand out free slots: displaced requests first, then the global queue in fair order.
        Queued tickets past their deadline leave first (`Expire`), never assigned."""
        actions: list = self.expire()
        placement = self.placement
        if not self._queued_routing:
            while (t := self.policy.peek()) is not None:
                r = placement.route_baseline(t)
                if r is None:
                    break
                self._pop()
                actions.append(self._assign(t, r))
            return actions
        if self.preemption.displaced and self.config.migrate_displaced:
            for t, src, dst in self.preemption.moves(placement):
                actions.append(self._move(t, src, dst))
        policy = self.policy
        while True:
            t = policy.peek()
            if t is None:
                break
            r = self._sibling_home(t) or placement.pick(t)
            if r is None:
                if self.config.preemption:
                    self._preempt_for(t, actions)
                break
            self._pop()
            actions.append(self._assign(t, r))
        if placement.queueing and self.config.rebalance_local_queues and policy.peek() is None:
            for t, src, dst in placement.steals():
                actions.append(self._move(t, src, dst, waiting_only=True))
        return actions

    def _sibling_home(self, t: Ticket) -> ReplicaState | None:
        """For a sibling sample: its parent's replica, if that has room (it forks there)."""
        parent = self.tickets.get(t.meta.fork_of) if t.meta and t.meta.fork_of else None
        if parent is None or parent.replica is None:
            return None
        r = self.placement.replicas.get(parent.replica)
        return r if r is not None and r.alive and r.has_room() else None

    def _assign(self, t: Ticket, r: ReplicaState) -> Assign:
        t.replica = r.replica_id
        t.assigned_at = self.clock()
        r.assigned[t.request_id] = t
        self.preemption.assigned(t)
        self.placement.charge_locality(t, r)
        self.placement.touch(r)
        self.num_admitted += 1
        if t.meta is not None and t.meta.attempt == 0:
            # Prepaid: the prompt and max_tokens of output are charged now, and what was not
            # generated is refunded when the request ends. Charging only what replicas report
            # lets a burst of admissions between two reports (or one wave of equal requests)
            # swing the counters by a batch's worth; prepaying makes each slot's allocation see
            # the work already committed. (A resubmission was prepaid by its first attempt.)
            self.policy.charge(t.tenant, t.meta.num_charged_prompt_tokens, t.max_tokens)
        return Assign(t, r.replica_id)

    def _preempt_for(self, t: Ticket, actions: list) -> None:
        """No slot anywhere and `t`, the head of the queue, waits. If some assigned request has
        a lower priority, preempt the cluster-wide victim and give its slot to `t`; else
        (`fair_preemption`) if a queued tenant's requests all fit in its share of the seats
        while another tenant holds more than its share, preempt for the former's next request
        (preemption.py). The
        victim's replica keeps the seat for the request it gave way to."""
        counters = self.policy.counters_view()
        victim = self.preemption.victim(t.priority, counters)
        if victim is None and self.config.fair_preemption:
            t, victim = self._fair_swap(counters)
        if victim is None or t is None:
            return
        r = self.replicas[victim.replica]  # type: ignore[index]
        self.preemption.displace(victim)
        self.num_preemptions += 1
        self.policy.remove(t, served=True)  # as a pop when `t` is the head
        self._unqueued(t)
        actions.append(
            Preempt(r.replica_id, victim.request_id, self.config.preempt_mode, t.request_id)
        )
        actions.append(self._assign(t, r))

    def _fair_swap(self, counters) -> tuple[Ticket | None, Ticket | None]:
        """(waiting, victim) for a fair preemption, or (None, None): among the queued tenants
        whose requests, assigned and queued, all fit in their share of the seats, the one
        holding the fewest seats per weight whose next request some over-share tenant's
        running request can give way to."""
        seats = sum(r.seats for r in self.replicas.values() if r.alive)
        held = self.preemption.held
        names = {*self._queued, *held}
        weights = {n: self.policy.tenant(n).weight for n in names}
        total = sum(weights.values())
        if not seats or total <= 0:
            return None, None
        shares = {n: seats * w / total for n, w in weights.items()}
        # Only a tenant whose whole demand (assigned + queued) fits in its share: a backlogged
        # tenant gets its share through the queue's order; preempting for it would only churn.
        under = [n for n in self._queued if held.get(n, 0) + self._queued[n] <= shares[n]]
        under.sort(key=lambda n: (held.get(n, 0) / weights[n], counters.get(n, 0.0), n))
        for name in under:
            waiting = self.policy.peek_tenant(name)
            if waiting is None:
                continue  # over its quota
            victim = self.preemption.fair_victim(waiting, shares, counters)
            if victim is not None:
                return waiting, victim
        return None, None

    def _move(
        self, t: Ticket, src: ReplicaState, dst: ReplicaState, waiting_only: bool = False
    ) -> Migrate:
        """Accounting moves at once; the caller carries the request over (and moves the
        accounting back with `migrate` if the replica refused)."""
        rid = t.request_id
        self._shift(t, src, dst)
        # Assigned to dst now, not seen there yet: not a candidate meanwhile, and dropped after
        # stale_assignment_s if it never arrives (its client died holding the move's marker).
        t.seen, t.assigned_at = False, self.clock()
        self._moving[rid] = src.replica_id
        self.num_migrations += 1
        return Migrate(rid, src.replica_id, dst.replica_id, waiting_only)

    def _shift(self, t: Ticket, src: ReplicaState, dst: ReplicaState) -> None:
        del src.assigned[t.request_id]
        self.placement.release_locality(t, src)
        self.placement.touch(src)
        t.replica = dst.replica_id
        dst.assigned[t.request_id] = t
        self.placement.touch(dst)

    def move_done(self, action: Migrate, ok: bool) -> list:
        """A `Migrate` was carried out (`ok`) or refused by its source, which kept the request
        (it had started, for a `waiting_only` move) or no longer had it (it ended there).
        Refused, the accounting goes back to the source, or the ticket ends if the source
        reported the request gone meanwhile; then the slot kept at the destination is served."""
        rid = action.request_id
        self._moving.pop(rid, None)
        num_out = self._left_while_moving.pop(rid, None)
        t = self.tickets.get(rid)
        if ok or t is None or t.replica != action.dst:
            return []  # moved (its source's report of it leaving was the move), or gone
        dst, src = self.replicas.get(action.dst), self.replicas.get(action.src)
        if num_out is not None or src is None:  # it ended at the source
            if dst is not None and dst.assigned.pop(rid, None) is not None:
                self._ended(t, dst, num_out or 0)
                self.placement.touch(dst)
        elif dst is not None:
            self._shift(t, dst, src)
            t.seen = True  # back where it was seen
            if action.waiting_only:  # and started there, as its source will report
                t.running = True
        return self.dispatch()

    def migrate(self, request_id: str, dst_id: str | None = None) -> Migrate | None:
        """Move a request to another replica (the least loaded one unless `dst_id`)."""
        t = self.tickets.get(request_id)
        if t is None or t.replica is None:
            return None
        src = self.replicas.get(t.replica)
        if dst_id:
            dst = self.replicas.get(dst_id)
        else:
            dst = self.placement.least_loaded_except(t.replica)
        if src is None or dst is None or dst is src:
            return None
        return self._move(t, src, dst)

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
        preemption = self.preemption
        for rid, num_out in rep.finished:
            t = r.assigned.pop(rid, None)  # None when it moved away from this replica
            if t is None and self._moving.get(rid) == r.replica_id:
                self._left_while_moving[rid] = num_out  # the move's end, or a finish
            if t is not None:
                self._charge_output(t, num_out)
                self._ended(t, r, num_out)
                changed = True
        if not r.synced:
            changed |= self._adopt(r, rep.active)
            r.synced = True
        now = self.clock()
        for rid, t in list(r.assigned.items()):
            state = rep.active.get(rid)
            if state is not None:
                t.seen, t.running = True, state[2]
                if state[4] > t.charged_out:
                    self._charge_output(t, state[4])
                if t.preempted and t.running:
                    preemption.resumed(t)  # resumed where it was
            elif not t.seen and now - t.assigned_at > self.config.stale_assignment_s:
                self._forget(t)  # its client never reached the replica
                self._refund(t, 0, never_ran=True)
                changed = True
        if rep.prefix_hashes is not None:
            self.placement.set_hashes(r, rep.prefix_hashes)
        r.loras = frozenset(rep.loras or ())
        if changed:
            self.placement.touch(r)
        if self.policy.wants_hit_length and (changed or rep.prefix_hashes is not None):
            self.policy.hits_changed()  # hit lengths: cached prefixes where there is room
        self._track_spread()
        return self.dispatch()

    def _ended(self, t: Ticket, r: ReplicaState, num_out: int) -> None:
        """`t` (taken out of r.assigned) ended on r with `num_out` output tokens."""
        self.preemption.unassigned(t)
        self.placement.release_locality(t, r)
        self._untrack(t)
        self.preemption.displaced.pop(t.request_id, None)
        self._refund(t, num_out)

    def _untrack(self, t: Ticket) -> None:
        if self.tickets.pop(t.request_id, None) is not None:
            self._uncount(t)

    def _uncount(self, t: Ticket) -> None:
        if t.counted:
            t.counted = False
            self.limits.ended(t.tenant)

    def set_limits(self, spec: LimitsSpec) -> None:
        """Enforce `spec` from now on; requests held now count in flight."""
        if self.limits is not None:
            self.limits.set_spec(spec)
            return
        self.limits = ClusterLimits(spec, self.clock)
        for t in self.tickets.values():
            self.limits.started(t.tenant)
            t.counted = True

    def _charge_output(self, t: Ticket, num_out: int) -> None:
        """Quotas charge output as its replica reports it (and its client, when it ends)."""
        if num_out > t.charged_out and self.limits is not None:
            self.limits.charge(t.tenant, num_out - t.charged_out)
            t.charged_out = num_out

    def client_ended(self, ended: list[tuple[str, int]]) -> None:
        """These requests' clients saw them end with this many output tokens: charged and out
        of the in-flight counts now, not at their replicas' next reports (a client that sends
        its next request as one ends is judged by what that one used). The tickets stay until
        the reports."""
        for rid, num_out in ended:
            t = self.tickets.get(rid)
            if t is not None:
                self._charge_output(t, num_out)
                self._uncount(t)

    def _refund(self, t: Ticket, num_out: int, never_ran: bool = False) -> None:
        """Give back the prepaid output not generated (and the prompt, if it never ran)."""
        unused = max(0, t.max_tokens - num_out)
        ran = never_ran and t.meta and not t.meta.attempt
        prompt = t.meta.num_charged_prompt_tokens if ran else 0
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
            t.charged_out = num_out  # before this controller: not its buckets'
            if self.limits is not None:
                self.limits.started(tenant)
                t.counted = True
            r.assigned[rid] = t
            self.preemption.assigned(t)
            changed = True
        return changed

    # ---- fairness metrics -------------------------------------------------------------------

    def _track_spread(self) -> None:
        if len(self._queued) < 2:
            return
        counters = self.policy.counters_view()
        values = [counters[name] for name in self._queued]
        self.max_counter_diff = max(self.max_counter_diff, max(values) - min(values))

    def counters(self) -> dict[str, float]:
        return self.policy.counters()

    def stats(self) -> dict:
        return {
            "queued": len(self.policy),
            "queued_by_tenant": dict(self._queued),
            "assigned": {r.replica_id: r.load for r in self.replicas.values()},
            "admitted": self.num_admitted,
            "preemptions": self.num_preemptions,
            "migrations": self.num_migrations,
            "counters": self.counters(),
            "service": self.policy.service(),
            "max_counter_diff": self.max_counter_diff,
        }
