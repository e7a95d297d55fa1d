"""Request deadlines: the requests with one, soonest first."""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterator

from fairbatch.scheduler.request import Request, RequestStatus


class Deadlines:
    """A heap of (time, n, request) over the requests with a finite deadline. Entries are never
    removed when a request leaves: the caller skips the ones that are stale."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Request]] = []
        self._n = itertools.count()

    def watch(self, request: Request, when: float | None = None) -> None:
        """Remember `request` until `when` (default: the sooner of its two deadlines)."""
        if when is None:
            when = min(request.deadline, request.queue_deadline)
        if when != math.inf:
            heapq.heappush(self._heap, (when, next(self._n), request))

    def due(self, now: float) -> bool:
        return bool(self._heap) and self._heap[0][0] <= now

    def expired(self, now: float, requests: dict[str, Request]) -> Iterator[tuple[Request, str]]:
        """The requests of `requests` past a deadline at `now`, each with its stage: "queue"
        (before its first token) or "running". The queue deadline holds until a request is
        first scheduled, the total deadline always; a request that started in time is watched
        again for its total deadline. Lazy: the caller may finish each before the next."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            request = heapq.heappop(heap)[2]
            if requests.get(request.request_id) is not request:
                continue  # finished, or moved to another replica
            started = (
                request.status == RequestStatus.RUNNING
                or request.num_cached_tokens is not None  # scheduled once (or forked)
                or request.num_output_tokens > 0  # resubmitted with its tokens so far
            )
            if now < request.deadline and (started or now < request.queue_deadline):
                self.watch(request, request.deadline)  # only the total deadline is left
                continue
            yield request, "running" if request.num_output_tokens else "queue"
