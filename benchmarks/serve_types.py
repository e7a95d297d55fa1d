"""The records `fairbatch bench serve` passes between its parts.

workload (serve_workload.py) -> list[RequestSpec] -> client (serve_bench.py) -> list[RequestResult]
-> metrics (serve_metrics.py) -> a JSON-ready dict -> plots (serve_plots.py).

Times are seconds. `arrival_s` is relative to the start of the run; the `*_s` times in a result
are relative to the same start, so a workload's schedule and its results share one time axis.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RequestSpec:
    """One request a workload will send."""

    index: int  # position in the workload (stable id for seeding and joins)
    tenant: str
    arrival_s: float  # when to send it, from the start of the run
    prompt: str  # the text sent as the completion prompt
    prompt_len: int  # intended prompt length in tokens (the server's count is in the result)
    max_tokens: int  # output length asked for (with ignore_eos where the server supports it)
    priority: int = 0  # sent as the `priority` field (fairbatch; peers may ignore it)
    shared_prefix: str | None = None  # the system-prompt group this prompt starts with, if any
    # deadlines in seconds from the send (fairbatch's `timeout` / `max_queue_time_s` fields);
    # goodput within deadline is measured against `timeout` client-side
    timeout: float | None = None
    max_queue_time_s: float | None = None


@dataclass
class RequestResult:
    """What happened to one request."""

    spec: RequestSpec
    ok: bool = False  # completed with a 200 and a finish_reason
    status: int = 0  # HTTP status (0: no response: connection error or timeout)
    error: str = ""  # error message or exception text when not ok
    retry_after_s: float | None = None  # from a 429/503's Retry-After
    send_s: float = 0.0  # when the request was actually sent
    first_token_s: float | None = None  # first content chunk arrived
    end_s: float = 0.0  # the response ended (or failed)
    # arrival of each streamed chunk with text (about one token each; ITLs are their gaps)
    chunk_times_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0  # the server's usage numbers (0 when not reported)
    completion_tokens: int = 0
    finish_reason: str = ""

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.send_s

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.send_s
