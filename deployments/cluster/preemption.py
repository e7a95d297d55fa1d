"""Coordinated preemption: which assigned request gives way to a waiting one, and where a
displaced request goes once another replica has room.

`Preemption` is part of `FairnessCore` (fairness.py), plain Python. Two reasons to give way,
both asked only when the request at the head of the global queue finds no slot anywhere:

* **Priority** (`victim`): an assigned request of a lower class, chosen by the rule a replica
  uses (`policies.victims.victim_key`): lowest priority first; within it running before waiting
  (a waiting victim frees no seat), the tenant with the highest counter, the latest admitted.
* **Fairness** (`fair_victim`): a running request of the same class whose tenant holds more
  than its fair share of the cluster's seats, for a waiting request of a tenant whose whole
  demand (requests assigned and queued) fits in its own share. A tenant's share is the seats
  times its weight over the weights of the active tenants (those with requests queued or
  assigned). Without it, a tenant asking less than its share waits for a seat until an
  over-share tenant's long request ends, however far over its share that tenant is: seats,
  not the queue's fair order, then decide who is served. A backlogged tenant (more requests
  than its share) never preempts: the queue's order gives it its share, and preempting for it
  would only move seats back and forth. The victim's tenant stays at or above its share
  without the seat. Victim: the tenant furthest over its share (seats / weight), then the
  highest counter, the latest admitted.

Assigned tickets are indexed by priority, so when nothing of a lower class is assigned the
priority check is O(classes); a fair check is O(active tenants) and scans the waiting
request's class only when the waiting tenant is under its share. Seats held per tenant
(assigned and not displaced) are counted as tickets come and go. A victim is *displaced*: its
replica preempts it (swap or recompute, by cost) and keeps its seat for the waiting request
(scheduler/seats.py); as soon as another replica has a free slot the victim is migrated there,
unless room came back at home first (then it resumes there).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from fairbatch.deployments.cluster.placement import Placement, ReplicaState
from fairbatch.deployments.cluster.tickets import Ticket
from fairbatch.policies.victims import victim_key


class Preemption:
    def __init__(self) -> None:
        self.by_priority: dict[int, dict[str, Ticket]] = {}  # assigned tickets per priority
        self.displaced: dict[str, Ticket] = {}  # preempted by the controller, not yet resumed
        self.held: dict[str, int] = {}  # tenant -> assigned tickets not displaced (seats held)

    def assigned(self, t: Ticket) -> None:
        level = self.by_priority.get(t.priority)
        if level is None:
            level = self.by_priority[t.priority] = {}
        level[t.request_id] = t
        if not t.preempted:
            self._hold(t.tenant, 1)

    def unassigned(self, t: Ticket) -> None:
        level = self.by_priority.get(t.priority)
        if level is not None and level.pop(t.request_id, None) is not None:
            if not level:
                del self.by_priority[t.priority]
            if not t.preempted:
                self._hold(t.tenant, -1)

    def _hold(self, tenant: str, n: int) -> None:
        held = self.held.get(tenant, 0) + n
        if held:
            self.held[tenant] = held
        else:
            del self.held[tenant]

    def victim(self, below: int, counters: Mapping[str, float]) -> Ticket | None:
        """The cluster-wide victim among assigned requests of priority < `below` by the
        replicas' rule (`victim_key`), or None."""
        candidates = (
            t
            for p, level in self.by_priority.items()
            if p < below
            for t in level.values()
            if not t.preempted and t.seen
        )
        return min(candidates, key=lambda t: victim_key(t, counters, not t.running), default=None)

    def fair_victim(
        self, waiting: Ticket, shares: Mapping[str, float], counters: Mapping[str, float]
    ) -> Ticket | None:
        """The running request of `waiting`'s class that gives its seat to `waiting` for
        fairness, or None. `shares`: each active tenant's share of the cluster's seats."""
        if self.held.get(waiting.tenant, 0) + 1 > shares.get(waiting.tenant, 0.0):
            return None
        best, best_key = None, None
        for t in self.by_priority.get(waiting.priority, {}).values():
            if t.preempted or not t.seen or not t.running:
                continue
            held, share = self.held.get(t.tenant, 0), shares.get(t.tenant, 0.0)
            if held - 1 < share:
                continue
            key = (-held / share if share else 0.0, -counters.get(t.tenant, 0.0), -t.seq)
            if best_key is None or key < best_key:
                best, best_key = t, key
        return best

    def displace(self, t: Ticket) -> None:
        t.preempted, t.running = True, False
        self.displaced[t.request_id] = t
        self._hold(t.tenant, -1)

    def resumed(self, t: Ticket) -> None:
        """It runs again where it was: no migration."""
        t.preempted = False
        self.displaced.pop(t.request_id, None)
        self._hold(t.tenant, 1)

    def moves(self, placement: Placement) -> Iterator[tuple[Ticket, ReplicaState, ReplicaState]]:
        """(ticket, src, dst) for displaced requests to migrate now, one at a time: the caller
        moves each before asking for the next (the loads change)."""
        for rid, t in list(self.displaced.items()):
            src = placement.replicas.get(t.replica or "")
            dst = placement.least_loaded()
            if src is None or dst is None or not dst.has_room() or dst is src:
                return
            if src.load <= src.slots:
                continue  # room came back at home: it resumes there
            del self.displaced[rid]
            t.preempted = False
            self._hold(t.tenant, 1)
            yield t, src, dst
