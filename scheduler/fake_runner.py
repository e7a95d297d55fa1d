"""A runner with no model: deterministic next tokens from the token history.

Used by scheduler tests and the scheduler benchmark. The next token depends only on the
request's tokens so far, so a request that is chunked, preempted, swapped or moved produces
exactly the tokens it would have produced undisturbed - the same property the real model has.
"""

from __future__ import annotations

from fairbatch.scheduler.output import RunnerOutput, SchedulerOutput


def next_token(all_token_ids: list[int], vocab_size: int) -> int:
    tail = all_token_ids[-3:]
    return (sum(tail) * 31 + len(all_token_ids) * 7 + 1) % vocab_size


class FakeRunner:
    def __init__(self, vocab_size: int = 1000) -> None:
        self.vocab_size = vocab_size
        self.num_steps = 0
        self.swap_in_blocks = 0
        self.swap_out_blocks = 0

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self.num_steps += 1
        self.swap_in_blocks += len(out.swap_in)
        self.swap_out_blocks += len(out.swap_out)
        sampled: dict[str, int] = {}
        num_scheduled = out.num_scheduled_tokens
        for req in out.scheduled:
            rid = req.request_id
            if req.num_computed_tokens + num_scheduled[rid] == len(req.all_token_ids):
                sampled[rid] = next_token(req.all_token_ids, self.vocab_size)
        return RunnerOutput(sampled_token_ids=sampled)
