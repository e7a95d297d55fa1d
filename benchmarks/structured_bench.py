"""The step-time cost of grammar masks: `fairbatch bench engine --structured`.

Two batches of the same 32 decoding requests on the embedded tiny model (its tokenizer gives
the grammars their vocabulary): one where half of them are constrained by JSON schemas (four
distinct ones, each a long array so no request finishes inside the measurement), one with no
constraint at all. Each measured step decodes one token for all 32; the result is the ratio of
the median step times (constrained / free), over interleaved rounds, median reported. The cost
measured is everything the grammar adds to a step: filling the bitmask rows, the one masking
call, and each matcher accepting its token.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

SCHEMAS = [
    {"type": "array", "items": {"type": "integer"}, "minItems": 400},
    {"type": "array", "items": {"type": "string"}, "minItems": 400},
    {
        "type": "object",
        "properties": {"rows": {"type": "array", "items": {"type": "number"}, "minItems": 400}},
        "required": ["rows"],
    },
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"k": {"enum": ["a", "b"]}, "v": {"type": "boolean"}},
            "required": ["k", "v"],
        },
        "minItems": 400,
    },
]


class _Timed:
    """Wraps a function and adds up the seconds spent in it."""

    def __init__(self, fn) -> None:
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args):
        t0 = time.perf_counter()
        try:
            return self.fn(*args)
        finally:
            self.seconds += time.perf_counter() - t0


def _batch(llm, constrained: int, batch: int, warmup: int, steps: int) -> tuple[float, ...]:
    """(median wall seconds per decode step, median CPU seconds per step, mean seconds of
    grammar work per step) of `batch` requests, `constrained` of them with a grammar."""
    from fairbatch.engine import SamplingParams
    from fairbatch.engine.structured import GrammarSpec

    engine = llm.engine
    for i in range(batch):
        spec = GrammarSpec.from_schema(SCHEMAS[i % len(SCHEMAS)]) if i < constrained else None
        params = SamplingParams(
            temperature=1.0, seed=i, max_tokens=warmup + steps + 8, ignore_eos=True,
            structured_output=spec,
        )  # fmt: skip
        engine.add_request(f"Request {i} of the benchmark:", params, request_id=f"b{i}")
    for _ in range(warmup):  # prefill, grammar compile (cached after the first round)
        engine.step()
    assert len(engine.scheduler.running) == batch, "every request must decode in each step"
    grammar = engine.structured
    timers = []
    if grammar is not None and constrained:  # the grammar's share of the step, timed apart
        mask, advance = _Timed(grammar.mask), _Timed(grammar.advance)
        engine.runner.logits_mask, grammar.advance = mask, advance
        timers = [mask, advance]
    wall, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        engine.step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    for i in range(batch):
        engine.abort(f"b{i}")
    engine.step()  # drain the aborts
    if timers:
        engine.runner.logits_mask, grammar.advance = grammar.mask, timers[1].fn
    # medians: robust to other jobs' bursts on a shared machine
    work = sum(t.seconds for t in timers) / steps
    return statistics.median(wall), statistics.median(cpu), work


def main(
    json_path: str | None = None,
    batch: int = 32,
    constrained: int = 16,
    steps: int = 100,
    rounds: int = 7,
    device: str = "cpu",
) -> dict:
    from fairbatch.engine import LLM

    llm = LLM("tiny", device=device, num_gpu_blocks=1024, max_num_seqs=batch)
    free_runs, masked_runs = [], []
    for _ in range(rounds):  # interleaved, so drift in machine load hits both alike
        free_runs.append(_batch(llm, 0, batch, 16, steps))
        masked_runs.append(_batch(llm, constrained, batch, 16, steps))
    free_s, free_cpu, _ = zip(*free_runs)
    masked_s, masked_cpu, grammar_s = zip(*masked_runs)
    ratios = [m / f for m, f in zip(masked_s, free_s)]
    cpu_ratios = [m / f for m, f in zip(masked_cpu, free_cpu)]
    free, work = statistics.median(free_s), statistics.median(grammar_s)
    result = {
        "batch": batch,
        "constrained": constrained,
        "steps_per_round": steps,
        "rounds": rounds,
        "device": device,
        "free_step_ms": round(1000 * free, 3),
        "constrained_step_ms": round(1000 * statistics.median(masked_s), 3),
        "ratio_median": round(statistics.median(ratios), 3),
        "ratios": [round(r, 3) for r in ratios],
        # the same from CPU time (this process, all threads): steadier under other jobs
        "cpu_ratio_median": round(statistics.median(cpu_ratios), 3),
        # the grammar work timed inside the step (masks + accepting tokens), and the ratio it
        # implies: (free step + that work) / free step, less noisy than two wall-clock runs
        "grammar_ms_per_step": round(1000 * work, 3),
        "ratio_from_grammar_work": round((free + work) / free, 3),
        "torch_threads": torch.get_num_threads(),
    }
    print(json.dumps(result, indent=2))
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))
    return result
