"""The cluster's usage log, kept by the fairness controller (plain Python, no Ray).

Each ingress composes a request's `UsageRecord` when the request ends there (it knows what
the client was billed), encodes it (the JSON line, so the one controller does not) and sends
(request id, line) with its next submission, within a second (`AdmissionBatcher.record`); the
controller appends it to the one log on its node, so two
ingresses never count a request twice. A request whose ingress died never gets that record,
so the ledger opens an entry for every request the controller takes and the ingress's record
closes it. An entry whose request has left the controller (ended on its replica, cancelled, or
expired) and that no record closed within `grace_s` is written by the controller from what
it knows: tenant, prompt, output tokens as its replica last reported, finish_reason
"ingress_lost". A record is written once per request id: a duplicate (an ingress's record
that comes after the controller wrote one, or a submission Ray retried across a controller
restart) is dropped, also across restarts (the ids of the log's recent records are read back
at start).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Container
from dataclasses import dataclass

from fairbatch.deployments.cluster.wire import RequestMeta
from fairbatch.deployments.usage import UsageLog, UsageRecord, UsageSpec

TAIL_BYTES = 8 << 20  # read back at start: the newest records' ids (duplicates after restarts)


@dataclass
class _Open:
    meta: RequestMeta
    arrival: float
    delivered: int  # output tokens its client had when it was last submitted
    num_out: int = 0  # output tokens its replica reported when it left there
    replica: str | None = None
    gone_since: float | None = None  # when it was first seen gone from the controller


class UsageLedger:
    def __init__(
        self,
        spec: UsageSpec,
        model: str,
        grace_s: float = 60.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.log = UsageLog(spec)
        self.model = model  # the base model's id (a request without an adapter ran it)
        self.grace_s = grace_s
        self.keep_s = max(600.0, 10 * grace_s)  # how long a written id is remembered
        self.clock = clock
        self.open: dict[str, _Open] = {}
        self.written: dict[str, float] = self._recent_ids()  # request id -> when written

    def _recent_ids(self) -> dict[str, float]:
        path = self.log.path
        if not path.exists():
            return {}
        now = self.clock()
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - TAIL_BYTES))
            lines = f.read().split(b"\n")[1 if size > TAIL_BYTES else 0 : -1]
        ids = {}
        for line in lines:
            try:
                r = json.loads(line)
            except ValueError:
                continue
            ids[r["request_id"]] = now
        return ids

    def submitted(self, meta: RequestMeta) -> None:
        """The controller took `meta` (a first submission or a resubmission)."""
        rid = meta.request_id
        if rid in self.written:
            return
        entry = self.open.get(rid)
        if entry is None:
            self.open[rid] = _Open(meta, self.clock(), len(meta.output_ids))
        else:
            entry.meta, entry.delivered, entry.num_out = meta, len(meta.output_ids), 0
            entry.gone_since = None

    def left_replica(self, rid: str, replica_id: str, num_out: int) -> None:
        """Its replica reported it gone (ended, aborted or moved away) with `num_out` tokens."""
        entry = self.open.get(rid)
        if entry is not None:
            entry.replica = replica_id
            entry.num_out = max(entry.num_out, num_out)

    def record(self, records: list[tuple[str, str]]) -> None:
        """Ingresses' records, (request id, JSON line): written, once per request id."""
        fresh = []
        now = self.clock()
        written, open_ = self.written, self.open
        for rid, line in records:
            if rid in written:
                continue
            written[rid] = now
            open_.pop(rid, None)
            fresh.append(line)
        self.log.write(fresh)

    def sweep(self, live: Container[str]) -> int:
        """Write the records of requests gone from the controller (`live`: the ids it still
        holds) that no ingress recorded within `grace_s`. Returns how many it wrote."""
        now = self.clock()
        lost = []
        for rid, entry in self.open.items():
            if rid in live:
                entry.gone_since = None
            elif entry.gone_since is None:
                entry.gone_since = now
            elif now - entry.gone_since >= self.grace_s:
                lost.append(rid)
        records = [self._lost(self.open.pop(rid), now) for rid in lost]
        for r in records:
            self.written[r.request_id] = now
        self.log.append(records)
        stale = [rid for rid, t in self.written.items() if now - t > self.keep_s]
        for rid in stale:
            del self.written[rid]
        return len(records)

    def _lost(self, entry: _Open, now: float) -> UsageRecord:
        meta = entry.meta
        lora = meta.params.lora
        output = entry.delivered + entry.num_out
        return UsageRecord(
            meta.request_id, meta.fork_of or meta.request_id, meta.tenant,
            self.model if lora is None else lora.name, meta.num_charged_prompt_tokens, 0,
            output, 0, "ingress_lost", entry.arrival, None, now, entry.replica, 0,
            meta.attempt, recorded_by="controller",
        )  # fmt: skip

    def summary(self, tenant: str | None, since: float, until: float) -> dict:
        return self.log.summary(tenant, since, until)

    def close(self) -> None:
        self.log.close()
