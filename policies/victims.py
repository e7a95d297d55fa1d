"""Victim choice of a `Policy`: which running request gives way when the scheduler preempts.

`VictimChoice` is a part of `Policy` (policies/base.py): it reads the policy's counters.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fairbatch.scheduler.request import Request


class VictimChoice:
    """The `Policy` methods on preemption."""

    def pick_victim(
        self, running: Iterable[Request], *, below_priority: int | None = None
    ) -> Request | None:
        """The request to preempt: lowest .priority, then the tenant with the highest counter,
        then the latest admission (highest .seq). With `below_priority`, only requests with
        .priority < below_priority are candidates. None if there is no candidate.
        """
        self._settle_all()
        counters = self._counters
        victim = None
        victim_key: tuple[int, float, int] | None = None
        for req in running:
            if below_priority is not None and req.priority >= below_priority:
                continue
            key = (req.priority, -counters.get(req.tenant, 0.0), -req.seq)
            if victim_key is None or key < victim_key:
                victim, victim_key = req, key
        return victim

    def effective_priority(self, req: Request) -> float:
        """The request's priority as the policy uses it: `.priority` (plus aging in `priority`)."""
        return float(req.priority)
