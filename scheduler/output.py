"""What the scheduler hands the runner each step, and what it hands back to the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from fairbatch.scheduler.request import Request


@dataclass
class SchedulerOutput:
    """Everything the runner needs to execute one step.

    The runner issues `kv_store` (device blocks the prefix cache evicted, kept in the host tier:
    their device blocks are written by everything after), `copy_blocks` (GPU block to GPU block:
    a forked sibling's copy of its parent's partial block, see `KVCacheManager.fork`), then
    `swap_in` copies, then `swap_out` copies, then `kv_load` (host-tier hits into blocks a
    swap-out of this step may have freed), then the forward, which does not read the loaded
    blocks (their requests compute from the next step). Copies go first because a copy's source
    may have been freed and be a swap-in's target in the same step, and a copy's target may be
    swapped out in it. No host block is both read and written in one step (the KV manager holds
    the ones read until the next). For each
    scheduled request it computes `num_scheduled_tokens[id]` tokens starting at position
    `request.num_computed_tokens`, and samples one token iff the chunk reaches the end of the
    request's known tokens (num_computed_tokens + n == num_tokens).
    """

    scheduled: list[Request] = field(default_factory=list)  # requests computing, in batch order
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # id -> tokens this step
    total_num_scheduled_tokens: int = 0  # sum of num_scheduled_tokens (<= the token budget)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)  # id -> new blocks, if any
    # id -> block table of every request holding GPU blocks: the KV manager's live mapping,
    # valid until the next schedule(); read only
    block_tables: dict[str, list[int]] = field(default_factory=dict)
    copy_blocks: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) GPU blocks
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, gpu) block copies
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu) block copies
    kv_store: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu): to the host tier
    kv_load: list[tuple[int, int]] = field(default_factory=list)  # (cpu, gpu): host tier hits
    loading: list[str] = field(default_factory=list)  # ids whose kv_load runs: not scheduled
    preempted_swap: list[str] = field(default_factory=list)  # ids swapped out this step
    preempted_recompute: list[str] = field(default_factory=list)  # ids dropped for recompute
    finished_ids: set[str] = field(default_factory=set)  # ids finished/aborted since last step
    # ids this step evicted past their deadline (finish reason "timeout") -> (tenant, stage):
    # stage "queue" (before its first token) or "running"; also in finished_ids
    timed_out: dict[str, tuple[str, str]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not (
            self.scheduled
            or self.copy_blocks
            or self.swap_in
            or self.swap_out
            or self.kv_store
            or self.kv_load
        )


@dataclass
class RunnerOutput:
    """The runner's answer: one sampled token per request whose chunk reached its end."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)  # id -> next token
    logprobs: dict[str, object] = field(default_factory=dict)  # id -> sampler's logprob record


@dataclass
class StepUpdates:
    """What one step changed, without an object per request (the hot path stays cheap).

    Iterating yields a RequestUpdate per request that got a token or finished.
    """

    new_tokens: dict[str, int] = field(default_factory=dict)  # id -> token sampled this step
    finished: dict[str, str] = field(default_factory=dict)  # id -> finish reason, this step

    def __iter__(self):
        fin = self.finished
        for rid, token in self.new_tokens.items():
            yield RequestUpdate(rid, [token], rid in fin, fin.get(rid))
        for rid, reason in fin.items():
            if rid not in self.new_tokens:
                yield RequestUpdate(rid, [], True, reason)

    def __len__(self) -> int:
        return len(self.new_tokens) + sum(1 for r in self.finished if r not in self.new_tokens)


@dataclass(slots=True)
class RequestUpdate:
    """A request's progress after one step, as the engine reports it to the caller."""

    request_id: str
    new_token_ids: list[int]  # tokens generated this step (0 or 1)
    finished: bool  # the request left the scheduler
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" when finished
