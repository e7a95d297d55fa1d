"""Seats kept for the requests the cluster controller preempted another request for.

The controller preempts a running request on a replica and assigns another there in its
place: one of a higher class, or one whose tenant holds less than its share of the cluster's
seats (deployments/cluster/preemption.py). The two reach the replica as separate calls; were the
freed seat simply free, the scheduler would give it to the first request it looks at: the victim
itself (swapped requests resume before waiting ones), or another request queued here. So the
seat is *kept*: it counts as taken for everyone else until its request runs, ends, or `hold_s`
passes without it arriving (its client went away). When its request waits here, it is admitted
before the swapped and the other waiting requests.
"""

from __future__ import annotations

from collections.abc import Mapping

from fairbatch.scheduler.request import Request, RequestStatus

HOLD_S = 5.0


class KeptSeats:
    def __init__(self, hold_s: float = HOLD_S) -> None:
        self.hold_s = hold_s
        self._until: dict[str, float] = {}  # request id -> when the seat stops being kept

    def __len__(self) -> int:
        return len(self._until)

    def keep(self, request_id: str, now: float) -> None:
        self._until[request_id] = now + self.hold_s

    def release(self, request_id: str) -> None:
        """Its request ran, or ended."""
        self._until.pop(request_id, None)

    def refresh(self, requests: Mapping[str, Request], now: float) -> int:
        """Drop the seats whose request no longer waits, or never came in time; returns how
        many are still kept."""
        for rid, until in list(self._until.items()):
            request = requests.get(rid)
            if request is None:
                if now > until:
                    del self._until[rid]
            elif request.status != RequestStatus.WAITING:
                del self._until[rid]
        return len(self._until)

    def waiting(self, requests: Mapping[str, Request]) -> list[Request]:
        """The kept seats' requests that wait here now, oldest first."""
        found = [requests.get(rid) for rid in self._until]
        return sorted(
            (r for r in found if r is not None and r.status == RequestStatus.WAITING),
            key=lambda r: r.seq,
        )
