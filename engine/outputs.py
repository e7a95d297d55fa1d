"""`RequestDelta`: what a step added to one request, the one type engine output has from the
engine's step to the API, through a cluster's replica and client too. Plain data: it pickles,
and imports neither torch nor ray."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class RequestDelta:
    """New tokens of one request (one step, or several coalesced)."""

    request_id: str
    token_ids: list[int]  # new token ids
    text: str  # new text ("" when no tokenizer, or held back at a UTF-8/stop boundary)
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "timeout" | "abort" | "error"
    # one sampler record per token in token_ids, [(sampled_id, lp), (top1_id, lp), ...];
    # None unless the request asked for logprobs
    logprobs: list[Any] | None = None
    # With the request's first tokens only: the prompt's log-prob records (when asked for:
    # entry 0 None, then one per prompt token) and the prompt tokens found in the prefix cache.
    prompt_logprobs: list[Any] | None = None
    num_cached_tokens: int | None = None
    # With the last delta: how often the engine preempted it (usage records)
    num_preemptions: int | None = None
    # In a cluster: the replica that produced these tokens (and its step count when the last
    # of them came out) and, with the last delta, set by the client, how many replicas the
    # request left on the way (migrations, resubmissions)
    replica_id: str | None = None
    num_moves: int | None = None
    step: int = 0
    error: str | None = None  # with finish_reason "error": what went wrong
