"""Where a request's time goes between processes: timestamps at each hop, for one tenant.

Off unless the environment that Ray's workers start with sets `FAIRBATCH_TRACE_DIR` (a folder
every process on the machine can write) and `FAIRBATCH_TRACE_TENANT` (whose requests to
trace). Each process then appends `request_id point value` lines to `<dir>/<pid>.log`, for
the first time each of a traced request's points is reached there. Times are
`time.monotonic()`, one clock for all processes on a machine, so hops between processes on
one machine subtract (across machines they do not). `summarize(dir)` reads them back.

The points, in the order a request passes them:

| point | where |
|---|---|
| `client` | `ClusterClient.generate` starts (the ingress, a handle caller or a driver) |
| `submit_sent` | the client's batched `submit_many` call goes to the controller |
| `controller` | the controller takes the submission |
| `forwarded` | the controller forwards it to its replica |
| `replica` | the replica takes it |
| `engine_added` | it is added on the engine thread (after the step running then) |
| `step_start`, `step_end` | the engine step that made its first token |
| `delivered` | that token's delta reaches the replica's event loop |
| `sent` | the replica writes it to the consumer's channel |
| `received` | the client reads it from the channel |
| `yielded` | the client hands it to its caller |

Besides times: `step_cpu` (s of CPU the engine thread used in that step) and `step_wait`
(s it was runnable but waiting for a core; Linux `schedstat`), which tell a slow step from a
starved one; `added_step` and `token_step` (the engine's step count when the request was added,
and the number of the step that made its first token), whose difference less one is how many
engine steps ran without it: a count, which the machine's speed does not change. Tracing is
for measuring: it costs a set lookup per item when on, one flag check when off.
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from collections import defaultdict
from typing import NamedTuple

log = logging.getLogger(__name__)

DIR = os.environ.get("FAIRBATCH_TRACE_DIR") or None
TENANT = os.environ.get("FAIRBATCH_TRACE_TENANT", "")
ON = DIR is not None and bool(TENANT)
MAX_TRACED = 100_000  # request ids one process remembers; past that it starts over

POINTS = (
    "client",
    "submit_sent",
    "controller",
    "forwarded",
    "replica",
    "engine_added",
    "step_start",
    "step_end",
    "delivered",
    "sent",
    "received",
    "yielded",
)
VALUES = ("step_cpu", "step_wait")
STEPS = ("added_step", "token_step")

_traced: dict[str, set[str]] = {}  # request id -> the points written for it here
_lock = threading.Lock()  # the engine thread writes too
_file = None
_failed = False  # the trace file could not be opened: nothing is traced here


def begin(request_id: str, tenant: str, point: str) -> None:
    """`request_id` reached `point`, and is traced here from now if `tenant` is the traced one."""
    if tenant == TENANT and not _failed:
        with _lock:
            if len(_traced) >= MAX_TRACED:
                _traced.clear()
            _traced.setdefault(request_id, set())
        mark(request_id, point)


def mark(request_id: str, point: str, value: float | None = None) -> None:
    """`request_id` reached `point` (now, or at `value`), if it is traced here."""
    points = _traced.get(request_id)
    if points is None or point in points:
        return
    global _file, _failed
    with _lock:
        points.add(point)
        if _file is None:
            path = os.path.join(DIR, f"{os.getpid()}.log")
            try:
                _file = open(path, "a", buffering=1)  # noqa: SIM115
            except OSError as e:  # a trace must never fail a request
                log.warning("trace: cannot write %s (%r); not tracing in this process", path, e)
                _failed = True
                _traced.clear()
                return
        _file.write(f"{request_id} {point} {time.monotonic() if value is None else value:.6f}\n")


class StepTimes(NamedTuple):
    """One step's: start and end (time.monotonic), the engine thread's CPU and wait for a
    core during it (s)."""

    start: float
    end: float
    cpu: float
    wait: float


class StepClock:
    """Times each step on the engine thread: begin() before it, stop() after, which returns
    the step's StepTimes."""

    def __init__(self) -> None:
        self._stat: str | None = None
        self._start = self._wait0 = self._cpu0 = 0.0

    def _waited(self) -> float:
        if self._stat is None:
            self._stat = f"/proc/self/task/{threading.get_native_id()}/schedstat"
        try:
            with open(self._stat) as f:
                return int(f.read().split()[1]) / 1e9
        except (OSError, ValueError, IndexError):  # not Linux
            return 0.0

    def begin(self) -> None:
        self._wait0, self._cpu0 = self._waited(), time.thread_time()
        self._start = time.monotonic()

    def stop(self) -> StepTimes:
        end, cpu = time.monotonic(), time.thread_time() - self._cpu0
        return StepTimes(self._start, end, cpu, self._waited() - self._wait0)


def read(folder: str) -> dict[str, dict[str, float]]:
    """Every traced request's points, as written by all processes."""
    requests: dict[str, dict[str, float]] = defaultdict(dict)
    for name in os.listdir(folder):
        if not name.endswith(".log"):
            continue
        with open(os.path.join(folder, name)) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3:
                    rid, point, value = parts
                    requests[rid].setdefault(point, float(value))
    return dict(requests)


def summarize(
    folder: str, since: float = float("-inf"), until: float = float("inf")
) -> dict[str, float]:
    """Median ms of each hop (`a->b`) over the requests whose `client` point lies in
    [since, until), with `step_cpu`, `step_wait` and `total` (`client->yielded`), and the most
    and median engine steps that ran between a request's arrival there and its first token's
    step (`steps_waited_max`, `steps_waited_median`); `n` is how many requests that is. Hops
    a request does not have (its client was in another process than its trace) are left out
    of that hop."""
    rows = [r for r in read(folder).values() if since <= r.get("client", float("-inf")) < until]
    out: dict[str, float] = {"n": len(rows)}
    for a, b in zip(POINTS, POINTS[1:]):
        hops = [r[b] - r[a] for r in rows if a in r and b in r]
        if hops:
            out[f"{a}->{b}"] = round(1000 * statistics.median(hops), 1)
    for name in VALUES:
        values = [r[name] for r in rows if name in r]
        if values:
            out[name] = round(1000 * statistics.median(values), 1)
    waited = [int(r["token_step"] - r["added_step"]) - 1 for r in rows if set(STEPS) <= r.keys()]
    if waited:
        out["steps_waited_max"] = max(waited)
        out["steps_waited_median"] = statistics.median(waited)
    totals = [r["yielded"] - r["client"] for r in rows if "client" in r and "yielded" in r]
    if totals:
        out["total"] = round(1000 * statistics.median(totals), 1)
    return out


if __name__ == "__main__":
    import json
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m fairbatch.deployments.cluster.trace FOLDER")
    print(json.dumps(summarize(sys.argv[1]), indent=1))
