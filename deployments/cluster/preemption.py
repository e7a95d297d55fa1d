"""Coordinated preemption: which assigned request gives way to a waiting one of higher
priority, and where a displaced request goes once another replica has room.

`Preemption` is part of `FairnessCore` (fairness.py), plain Python. Assigned tickets are
indexed by priority, so when nothing of a lower class is assigned the check is O(classes);
otherwise the lowest class is scanned, which happens when a preemption is due, not per
admission. The victim: lowest priority; within it running before waiting (a waiting victim
frees no seat), the tenant with the highest counter, the latest admitted. It is *displaced*:
its replica preempts it, and as soon as another replica has a free slot it is migrated there,
unless room came back at home first (then it resumes there).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from fairbatch.deployments.cluster.placement import Placement, ReplicaState
from fairbatch.deployments.cluster.tickets import Ticket


class Preemption:
    def __init__(self) -> None:
        self.by_priority: dict[int, dict[str, Ticket]] = {}  # assigned tickets per priority
        self.displaced: dict[str, Ticket] = {}  # preempted by the controller, not yet resumed

    def assigned(self, t: Ticket) -> None:
        level = self.by_priority.get(t.priority)
        if level is None:
            level = self.by_priority[t.priority] = {}
        level[t.request_id] = t

    def unassigned(self, t: Ticket) -> None:
        level = self.by_priority.get(t.priority)
        if level is not None:
            level.pop(t.request_id, None)
            if not level:
                del self.by_priority[t.priority]

    def victim(self, below: int, counters: Mapping[str, float]) -> Ticket | None:
        """The cluster-wide victim among assigned requests of priority < `below`, or None."""
        lower = [p for p in self.by_priority if p < below]
        if not lower:
            return None
        best, best_key = None, None
        for p in sorted(lower):
            for t in self.by_priority[p].values():
                if t.preempted or not t.seen:
                    continue
                # A waiting victim frees no seat: prefer running ones within the class.
                key = (not t.running, -counters.get(t.tenant, 0.0), -t.seq)
                if best_key is None or key < best_key:
                    best, best_key = t, key
            if best is not None:
                return best
        return None

    def displace(self, t: Ticket) -> None:
        t.preempted, t.running = True, False
        self.displaced[t.request_id] = t

    def resumed(self, t: Ticket) -> None:
        """It runs again where it was: no migration."""
        t.preempted = False
        self.displaced.pop(t.request_id, None)

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
            yield t, src, dst
