"""Plain data that crosses actor boundaries: request metadata, stream items, replica reports.

Everything here pickles (Ray ships it between processes) and imports neither torch nor ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fairbatch.engine.sampling_params import SamplingParams
from fairbatch.policies.quota import Rejected

FIRST_ONLY = ("prompt_logprobs", "num_cached_tokens")  # StreamItem fields a request gets once


@dataclass
class RequestMeta:
    """One request as the client submits it (again, after a replica died)."""

    request_id: str
    prompt_ids: list[int]  # the original prompt, never extended
    params: SamplingParams  # unchanged across resubmissions (seed, max_tokens, stops)
    tenant: str = "default"
    priority: int = 0
    cache_salt: str | None = None
    output_ids: list[int] = field(default_factory=list)  # already delivered to the caller
    prefix_hashes: list[bytes] = field(default_factory=list)  # leading full blocks (affinity)
    attempt: int = 0  # resubmissions so far (a replica died under it)
    # sample i >= 1 of the prompt of request `fork_of` (n > 1): sent to that request's replica
    # when it has room, where it shares the prompt's KV blocks; its prompt is not charged
    fork_of: str | None = None
    # Absolute wall-clock deadlines (time.time(); None: none), set once where the request
    # arrives: a resubmission or a move keeps them (each process turns them into its own clock)
    deadline: float | None = None  # the request ends with "timeout"
    queue_deadline: float | None = None  # ... unless it was first scheduled by this one
    # The client's channel id (`ReplicaLink.consumer`): the controller, when it assigns the
    # request, submits it to the replica, with the items going to that channel; the client
    # reads them. None: nobody reads it (the controller only places it: admission benchmarks)
    consumer: str | None = None

    def set_deadlines(self, now: float) -> None:
        """Fix the deadlines from the params' relative `timeout` / `max_queue_time_s`."""
        params = self.params
        self.deadline = None if params.timeout is None else now + params.timeout
        queue = params.max_queue_time_s
        self.queue_deadline = None if queue is None else now + queue

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_charged_prompt_tokens(self) -> int:
        """The prompt tokens its tenant pays for: a sibling sample's were paid by sample 0."""
        return 0 if self.fork_of is not None else len(self.prompt_ids)


@dataclass
class StreamItem:
    """New tokens of one request (one step, or several coalesced)."""

    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    step: int = 0  # the replica's step count when the last of these tokens came out
    replica_id: str = ""
    error: str | None = None  # with finish_reason "error": what went wrong
    # one sampler record per token in token_ids, [(sampled_id, lp), (top1_id, lp), ...];
    # None unless the request asked for logprobs
    logprobs: list | None = None
    request_id: str = ""  # whose tokens (a channel message carries many requests' items)
    # With the request's first tokens only (`RequestDelta`'s fields): the prompt's log-prob
    # records when asked for (entry 0 None, then one per prompt token), and the prompt tokens
    # its admission found in the prefix cache. The client passes each on once per request.
    prompt_logprobs: list | None = None
    num_cached_tokens: int | None = None
    num_preemptions: int | None = None  # with the last item: the engine's count (usage)
    # with the last item, set by the client: the replicas the request left on the way
    num_moves: int | None = None


@dataclass
class Moved:
    """The last item of a stream whose request left for another replica: attach there. With
    `replica` None (a drain) it went back to the controller's queue: submit it again."""

    request_id: str
    replica_id: str
    replica: Any  # the destination's actor handle (None: back to the controller's queue)
    migrated: Any  # ObjectRef of the MigratedRequest (K/V as numpy when it was swapped)


@dataclass
class Assignment:
    """The controller's answer to a submission: where the request runs (the controller has
    submitted it there for its consumer)."""

    request_id: str
    replica_id: str
    replica: Any  # actor handle (None on the `assignments` stream once it sent the handle)
    # set when the request left the controller's queue without a replica: "timeout" (its
    # queue deadline passed); the caller ends its stream with it
    finish_reason: str | None = None
    # set when the controller refused it (a tenant's cluster-wide quota or bound, limits.py):
    # the caller raises it
    refused: Rejected | None = None


@dataclass
class ReplicaReport:
    """A replica's periodic state, batched (one per report interval at most)."""

    replica_id: str
    seq: int  # increases by one per report sent; the controller ignores older ones
    max_num_seqs: int  # running slots
    free_blocks: int
    total_blocks: int
    block_size: int
    num_waiting: int
    num_running: int
    num_swapped: int
    num_steps: int
    # tenant -> cumulative raw (prefill, decode) tokens charged on this replica since it
    # started; cumulative, so a lost report or a restarted controller loses nothing
    service: dict[str, tuple[int, int]]
    # (request id, output tokens it ended with) for requests that left this replica since the
    # last delivered report (finished, aborted, or moved away)
    finished: list[tuple[str, int]]
    # request id -> (tenant, priority, running, max_tokens, output tokens so far), all it holds;
    # `running`: it holds a seat (or has just ended, its last items not delivered yet)
    active: dict[str, tuple[str, int, bool, int, int]]
    prefix_hashes: list[bytes] | None = None  # cached full-block hashes; None = unchanged
    loras: list[str] | None = None  # LoRA adapters in its slots (engine names); None = none
    handle: Any = None  # the replica's own actor handle (registration, after restarts)
