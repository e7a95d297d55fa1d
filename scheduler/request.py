"""One request's scheduling state.

There is no prefill or decode phase: a request has `num_tokens` (prompt + generated so far) and
`num_computed_tokens` (tokens whose K/V is in the cache). A step computes some of the difference;
prefill, chunked prefill, decode and resume after recompute are one code path.
"""

from __future__ import annotations

import enum
import itertools
import math
import time
from collections.abc import Iterable, Iterator, Sequence

MAX_TOKEN_ID = 2**32 - 1  # the prefix cache packs token ids as uint32 (kv.block_pool)


def lora_salt(salt: str, lora_name: str | None) -> str:
    """The prefix-cache salt of a request with `salt` run under adapter `lora_name` (None: the
    base model, `salt` itself). The cluster's client hashes prompts with it too, so a request
    is routed to the replica caching its prefix under the same adapter."""
    return salt if lora_name is None else f"{salt}\x00lora:{lora_name}"


class RequestStatus(enum.IntEnum):
    WAITING = 0  # queued; has no GPU blocks (new, or preempted for recompute)
    RUNNING = 1  # holds GPU blocks and is scheduled every step it fits
    SWAPPED = 2  # its K/V sits in CPU swap blocks; comes back by swap-in
    FINISHED_STOPPED = 3  # hit a stop token (or a stop string, reported by the engine)
    FINISHED_LENGTH = 4  # reached max_tokens or the context limit
    FINISHED_ABORTED = 5  # cancelled by the caller or the controller
    FINISHED_ERROR = 6  # could never run (e.g. longer than the whole KV pool)
    FINISHED_TIMEOUT = 7  # past its deadline (Scheduler: deadlines)

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
    RequestStatus.FINISHED_TIMEOUT: "timeout",
}


class Request:
    """A request as the scheduler, the KV manager and the policies see it (no tensors)."""

    __slots__ = (
        "request_id",
        "num_computed_tokens",
        "all_token_ids",
        "status",
        "max_num_tokens",
        "stop_token_ids",
        "tenant",
        "priority",
        "prompt_token_ids",
        "num_prompt_tokens",
        "max_tokens",
        "arrival_time",
        "cache_salt",
        "num_preemptions",
        "num_prompt_charged",
        "sampling_params",
        "seq",
        "prompt_logprobs",
        "num_cached_tokens",
        "fork_of",
        "deadline",
        "queue_deadline",
        "lora_name",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        *,
        tenant: str = "default",
        priority: int = 0,
        stop_token_ids: Iterable[int] = (),
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        sampling_params: object = None,
        deadline: float = math.inf,
        queue_deadline: float = math.inf,
        lora_name: str | None = None,
    ) -> None:
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError("prompt_token_ids must not be empty")
        if min(prompt) < 0 or max(prompt) > MAX_TOKEN_ID:
            raise ValueError(f"token ids must be in [0, {MAX_TOKEN_ID}] (vocabulary indices)")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.request_id = request_id
        self.tenant = tenant
        self.priority = priority  # higher = more important
        self.prompt_token_ids = prompt
        self.num_prompt_tokens = len(prompt)
        # prompt + output: the one list a sampled token is appended to (output_token_ids is
        # a view of its tail), what the runner reads and the prefix cache hashes
        self.all_token_ids = list(prompt)
        self.max_tokens = max_tokens
        # prompt + output length at which the request ends; the scheduler lowers it to its
        # context limit when it adopts the request
        self.max_num_tokens = self.num_prompt_tokens + max_tokens
        self.stop_token_ids = frozenset(stop_token_ids)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # Prefix-cache salt: blocks are shared only between requests with the same salt.
        # Default: the tenant name, so tenants never share cached blocks (the engine may add
        # its model's: EngineCore.make_request).
        self.cache_salt = tenant if cache_salt is None else cache_salt
        # The LoRA adapter it runs under (None: the base model). Its K/V differ from the base
        # model's and other adapters', so the adapter salts the prefix cache too.
        self.lora_name = lora_name
        self.cache_salt = lora_salt(self.cache_salt, lora_name)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        # Prompt tokens already charged to the tenant: recompute after preemption is not the
        # tenant's fault and is not charged twice.
        self.num_prompt_charged = 0
        self.sampling_params = sampling_params  # opaque to the scheduler; the engine's
        # The prompt's log-prob records while asked for (SamplingParams.prompt_logprobs):
        # filled by the runner; the scheduler reads only whether any is missing (those need
        # logits, so the prefix cache is bypassed until they are all there).
        self.prompt_logprobs: PromptLogprobs | None = None
        # Prompt tokens its first admission found in the prefix cache (None: not yet admitted).
        self.num_cached_tokens: int | None = None
        # Scheduler-owned: the parent whose prefill this sibling sample waits for (see
        # Scheduler.add_request's fork_of), None once it is released or for other requests
        self.fork_of: str | None = None
        # Absolute times in the scheduler's clock (inf: none). `deadline`: the request ends
        # with "timeout" wherever it is; `queue_deadline`: it must be scheduled by then.
        self.deadline = deadline
        self.queue_deadline = queue_deadline
        self.seq = 0  # admission sequence number, set by the scheduler (FIFO tie-break)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> OutputTokens:
        """The tokens generated so far: a live, read-only view of `all_token_ids`' tail."""
        return OutputTokens(self.all_token_ids, self.num_prompt_tokens)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tenant={self.tenant!r}, prio={self.priority}, "
            f"{self.status.name}, computed={self.num_computed_tokens}/{self.num_tokens})"
        )


class PromptLogprobs:
    """Log-prob records of a request's prompt tokens, as its prefill computes them.

    `entries[i]` (i >= 1) is the record of prompt token i under the model given tokens < i:
    `[(token_i, logprob), (top1, logprob), ...]`, the sampler's format; `entries[0]` stays
    None (nothing precedes the first token). `sent`: the engine has delivered them.
    """

    __slots__ = ("entries", "num_missing", "top", "sent")

    def __init__(self, num_prompt_tokens: int, top: int) -> None:
        self.entries: list = [None] * num_prompt_tokens
        self.num_missing = num_prompt_tokens - 1
        self.top = top  # how many most likely tokens each record lists
        self.sent = False

    def __getstate__(self):
        return (self.entries, self.num_missing, self.top, self.sent)

    def __setstate__(self, state) -> None:
        self.entries, self.num_missing, self.top, self.sent = state


class OutputTokens(Sequence[int]):
    """`tokens[start:]` without the copy, live: it grows as `tokens` does. A request's output
    is the tail of its one token list, so a step appends each sampled token once."""

    __slots__ = ("_tokens", "_start")

    def __init__(self, tokens: list[int], start: int) -> None:
        self._tokens = tokens
        self._start = start

    def __len__(self) -> int:
        return len(self._tokens) - self._start

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self._tokens[self._start :][index]
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError("output token index out of range")
        return self._tokens[self._start + index]

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(self._tokens, self._start, None)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (OutputTokens, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # live and mutable, like the list it views

    def __repr__(self) -> str:
        return f"OutputTokens({self._tokens[self._start :]!r})"
