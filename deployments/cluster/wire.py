"""Plain data that crosses actor boundaries: request metadata, assignments, move markers,
replica reports (engine output crosses as `engine.outputs.RequestDelta`).

Everything here pickles (Ray ships it between processes) and imports neither torch nor ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fairbatch.engine.sampling_params import SamplingParams
from fairbatch.policies.quota import Rejected

# RequestDelta fields a request gets once (its client passes each on once, also after a move)
FIRST_ONLY = ("prompt_logprobs", "num_cached_tokens")


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
    # reads them. Required by the controller actor (`submit_many`); a `FairnessCore` driven
    # in-process (simulations) has no channels and leaves it None.
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
