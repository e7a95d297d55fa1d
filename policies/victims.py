"""Who gives way when something must be preempted, on a replica (`VictimChoice`, a part of
`Policy`) and at the controller (deployments/cluster/preemption.py): one rule, `victim_key`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fairbatch.scheduler.request import Request


def victim_key(req: Request, counters: Mapping[str, float], waiting: bool = False) -> tuple:
    """Sort key of a preemption candidate (a request, or anything with its .priority, .tenant
    and .seq); the smallest gives way first. The lowest priority; within it a running request
    before a waiting one (a waiting one frees no seat); then the tenant with the highest
    counter (the most served); then the latest admitted (highest .seq)."""
    return (req.priority, waiting, -counters.get(req.tenant, 0.0), -req.seq)


class VictimChoice:
    """The `Policy` method on preemption."""

    def pick_victim(
        self, running: Iterable[Request], *, below_priority: int | None = None
    ) -> Request | None:
        """The running request to preempt by `victim_key`, or None if there is no candidate.
        With `below_priority`, only requests with .priority < below_priority are candidates."""
        self._settle_all()
        counters = self._counters
        if below_priority is not None:
            running = [r for r in running if r.priority < below_priority]
        return min(running, key=lambda r: victim_key(r, counters), default=None)
