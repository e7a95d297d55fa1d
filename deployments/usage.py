"""Usage records: one JSON line per request that ended, for billing and charge-back.

`UsageRecord` is what a request used, written once when it ends, whichever way it ended (a
request refused before it was admitted never ran and has none). `UsageLog` appends records to
one JSON-lines file and rotates it by size (`usage.jsonl`, then `usage.jsonl.1` the newest
rotated file, up to `backups` of them); `summary()` sums the records that ended in a period,
per tenant. One process writes a log: the one-engine server its own, a cluster's fairness
controller the cluster's (ingresses send their records there), so nothing is counted twice.

Plain Python: no ray, no torch.
"""

from __future__ import annotations

import json
import math
import os
import threading
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path


@dataclass
class UsageRecord:
    """One request (one sample of a response with n > 1, one prompt of a batch) that ended.

    Token counts are what its client was billed: `prompt_tokens` is 0 for samples 1.. of a
    prompt (they share sample 0's prompt), `output_tokens` counts every token delivered,
    `reasoning_tokens` the part of them a reasoning parser split off (0 where none did).
    Times are Unix seconds; `first_token` None when it produced none. `replica` is the one
    that finished it (None on the one-engine server); `moves` the replicas it left on the way
    (migrations, and resubmissions after a replica died); `preemptions` how often the replica
    that finished it preempted it. `finish_reason`: the engine's "stop", "length", "timeout",
    "abort", "error"; or "client_gone" (its client left first), "refused" (a cluster-wide limit
    refused it after its ingress admitted it), "ingress_lost" (its ingress died; the controller
    wrote it)."""

    request_id: str
    response_id: str  # the API response it belongs to (one response may hold several)
    tenant: str
    model: str
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    reasoning_tokens: int
    finish_reason: str
    arrival: float
    first_token: float | None
    end: float
    replica: str | None = None
    preemptions: int = 0
    moves: int = 0
    recorded_by: str = "ingress"  # "controller": its ingress died before it recorded it

    def to_json(self) -> str:
        return json.dumps(self.__dict__, separators=(",", ":"))  # (fields are plain values)


@dataclass(frozen=True)
class UsageSpec:
    """Where a log lives and how it rotates: at `max_bytes` the file becomes `<path>.1` (the
    older ones shift up) and a new one starts; `backups` rotated files are kept."""

    path: str
    max_bytes: int = 64 << 20
    backups: int = 10

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("usage.path: must not be empty")
        if self.max_bytes < 1024:
            raise ValueError(f"usage.max_bytes: must be >= 1024, got {self.max_bytes}")
        if self.backups < 0:
            raise ValueError(f"usage.backups: must be >= 0, got {self.backups}")


class UsageLog:
    """An append-only JSON-lines file of `UsageRecord`s, rotated by size. Each `append` is
    written and flushed at once (a process that dies loses nothing it appended); readers see
    whole lines only."""

    def __init__(self, spec: UsageSpec) -> None:
        self.spec = spec
        self.path = Path(spec.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # appends (event loop) vs. summaries (a thread)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (kept open)
        self._size = self._file.tell()

    def append(self, records: list[UsageRecord]) -> None:
        self.write([r.to_json() for r in records])

    def write(self, lines: list[str]) -> None:
        """Append records already encoded (`UsageRecord.to_json`, one line each)."""
        if not lines:
            return
        text = "\n".join(lines) + "\n"
        size = len(text.encode("utf-8"))
        with self._lock:
            if self._size and self._size + size > self.spec.max_bytes:
                self._rotate()
            self._file.write(text)
            self._file.flush()
            self._size += size

    def _rotate(self) -> None:
        self._file.close()
        n = self.spec.backups
        if n == 0:
            self.path.unlink(missing_ok=True)
        else:
            oldest = self._rotated(n)
            oldest.unlink(missing_ok=True)
            for i in range(n - 1, 0, -1):
                if self._rotated(i).exists():
                    os.replace(self._rotated(i), self._rotated(i + 1))
            os.replace(self.path, self._rotated(1))
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self._size = 0

    def _rotated(self, i: int) -> Path:
        return self.path.with_name(f"{self.path.name}.{i}")

    def files(self) -> list[Path]:
        """The log's files, oldest first."""
        rotated = [self._rotated(i) for i in range(self.spec.backups, 0, -1)]
        return [p for p in [*rotated, self.path] if p.exists()]

    def records(self) -> list[dict]:
        """Every record still kept, oldest first."""
        out = []
        with self._lock:
            files = self.files()
            for path in files:
                with open(path, encoding="utf-8") as f:
                    out.extend(json.loads(line) for line in f if line.endswith("\n"))
        return out

    def summary(self, tenant: str | None, since: float, until: float) -> dict:
        """Per-tenant sums of the records that ended in [since, until) (Unix seconds)."""
        return summarize(self.records(), tenant, since, until)

    def close(self) -> None:
        with self._lock:
            self._file.close()


SUMMED = ("prompt_tokens", "cached_tokens", "output_tokens", "reasoning_tokens")


def summarize(records: list[dict], tenant: str | None, since: float, until: float) -> dict:
    """{"since", "until", "tenants": {name: {"requests", the token sums, "finish_reasons":
    {reason: requests}}}} over the records (dicts) that ended in [since, until), of `tenant`
    only when given."""
    tenants: dict[str, dict] = {}
    for r in records:
        if not since <= r["end"] < until or (tenant is not None and r["tenant"] != tenant):
            continue
        s = tenants.get(r["tenant"])
        if s is None:
            s = tenants[r["tenant"]] = {"requests": 0, **dict.fromkeys(SUMMED, 0)}
            s["finish_reasons"] = {}
        s["requests"] += 1
        for key in SUMMED:
            s[key] += r[key]
        reasons = s["finish_reasons"]
        reasons[r["finish_reason"]] = reasons.get(r["finish_reason"], 0) + 1
    return {"since": _bound(since), "until": _bound(until), "tenants": tenants}


def _bound(t: float) -> float | None:
    return None if math.isinf(t) else t


def parse_period(since: str | None, until: str | None) -> tuple[float, float]:
    """[since, until) in Unix seconds from query values: Unix seconds or ISO 8601 (a time
    without a zone is UTC); None: unbounded. ValueError naming the bad one, or when since is
    not before until."""
    lo = -math.inf if since is None else _time(since, "since")
    hi = math.inf if until is None else _time(until, "until")
    if not lo < hi:
        raise ValueError(f"since ({since}) must be before until ({until})")
    return lo, hi


def _time(value: str, name: str) -> float:
    try:
        t = float(value)
    except ValueError:
        try:
            when = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise ValueError(
                f"{name}: {value!r} is neither Unix seconds nor an ISO 8601 time"
            ) from None
        if when.tzinfo is None:
            when = when.replace(tzinfo=timezone.utc)
        t = when.timestamp()
    if not math.isfinite(t):
        raise ValueError(f"{name}: {value!r} is not a finite time")
    return t
