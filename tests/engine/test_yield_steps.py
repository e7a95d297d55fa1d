"""A step gives way to a higher class inside its forward (`yield_steps`): the step computes
and samples nothing, every request keeps its progress, the next step runs the higher-class
request's prefill alone, and every request's tokens are exactly those of a run in which the
higher-class request had simply been added before that step (and run beside the others). A
step never gives way to a class it already runs (or a lower one)."""

import asyncio
import threading

import pytest

from fairbatch.engine import SamplingParams
from fairbatch.engine.async_engine import AsyncEngine
from fairbatch.engine.llm import build_engine

LOW = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
HIGH = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
LONG_PROMPT = [(7 * j + 3) % 1900 + 20 for j in range(40)]  # three chunks at a budget of 24
HIGH_PROMPT = [(11 * j + 5) % 1900 + 20 for j in range(20)]


def engine_core():
    # 3 seats for 4 requests: the higher-class request takes a seat by preempting one; a token
    # budget of 24 chunks the long prompt, so the step that gives way holds a prefill chunk.
    return build_engine(
        "tiny", num_gpu_blocks=64, max_num_seqs=3, max_num_batched_tokens=24, policy="priority"
    )


def progress(core) -> dict:
    # (a step's admissions stand: a waiting request it started stays running)
    return {
        r.request_id: (r.num_computed_tokens, list(r.all_token_ids))
        for r in core.scheduler.iter_requests()
    }


def run(give_way_at: int | None, add_high_at: int = 2) -> tuple[dict, int, list]:
    """Three class-0 requests; a class-10 one arrives before step `add_high_at`. With
    `give_way_at` == `add_high_at` it arrives while that step runs, which gives way to it."""
    core = engine_core()
    core.add_request("fair batching", LOW, request_id="a")
    core.add_request(LONG_PROMPT, LOW, request_id="b")
    core.add_request("tenants", LOW, request_id="c")
    waiting: list[int | None] = [None]
    if give_way_at is not None:
        assert core.yield_steps(lambda: waiting[0])
    tokens: dict[str, list[int]] = {}
    given_way: list[dict] = []  # per step that gave way: (deltas, progress before, after)
    step = 0
    while core.has_unfinished():
        if step == add_high_at and give_way_at is None:
            core.add_request(HIGH_PROMPT, HIGH, request_id="h", priority=10)
        if step == give_way_at:
            waiting[0] = 10  # (what AsyncEngine reports while the request's add waits)
            before = progress(core)
            deltas = core.step()
            given_way.append({"deltas": deltas, "before": before, "after": progress(core)})
            waiting[0] = None
            core.add_request(HIGH_PROMPT, HIGH, request_id="h", priority=10)
        else:
            deltas = core.step()
            if step - 1 == give_way_at:  # the step after: who got a token
                given_way[-1]["next"] = sorted({d.request_id for d in deltas if d.token_ids})
        for d in deltas:
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
        step += 1
    core.check_integrity()
    assert core.scheduler.kv.all_free()
    assert core.scheduler.num_alone_steps == (give_way_at is not None)
    return tokens, core.num_interrupted_steps, given_way


@pytest.mark.parametrize("at", [1, 2, 4])
def test_a_step_that_gives_way_computes_nothing_and_changes_no_tokens(at):
    ref, ref_given_way, _ = run(None, add_high_at=at)
    got, given_way, steps = run(at, add_high_at=at)
    assert ref_given_way == 0 and given_way == 1
    (step,) = steps
    assert not any(d.token_ids for d in step["deltas"]), step["deltas"]
    # every request's progress and tokens as they were before the step
    assert step["after"] == step["before"]
    assert step["next"] == ["h"]  # its prefill alone (the others' decodes wait that step)
    assert got == ref
    assert {k: len(v) for k, v in got.items()} == {"a": 12, "b": 12, "c": 12, "h": 6}


def test_a_step_never_gives_way_to_a_class_it_runs():
    core = engine_core()
    core.add_request("fair batching", LOW, request_id="a")
    core.add_request(HIGH_PROMPT, HIGH, request_id="h", priority=10)
    waiting: list[int | None] = [0]
    core.yield_steps(lambda: waiting[0])
    core.step()  # class 10 runs: a waiting class 0 does not stop it
    waiting[0] = 10
    core.step()  # nor a waiting class 10
    assert core.num_interrupted_steps == 0
    waiting[0] = None  # (AsyncEngine clears it once the add is taken)
    while core.has_unfinished():
        core.step()
    waiting[0] = 5
    core.add_request("tenants", LOW, request_id="c")
    core.step()  # class 0 runs: a waiting class 5 stops it
    assert core.num_interrupted_steps == 1


def test_async_engine_gives_way_to_a_higher_class_added_mid_step():
    """Through AsyncEngine: `generate(..., priority=10)` while a step of class 0 runs makes
    that step give way (the add's class is known to the engine thread while it waits); every
    stream's tokens equal those of the engine without giving way."""

    def streams(yield_steps: bool):
        core = engine_core()
        engine = AsyncEngine(core, yield_steps=yield_steps)
        inside, hold = threading.Event(), threading.Event()
        give_way = core.runner.give_way

        def held_give_way():
            # once asked: stop inside a step until the class-10 add waits for the engine thread
            if hold.is_set() and core._step_class == 0:
                hold.clear()
                inside.set()
                for _ in range(5000):
                    if engine._waiting_class is not None:
                        break
                    threading.Event().wait(0.001)
            if give_way is not None:
                give_way()

        core.runner.give_way = held_give_way

        async def one(prompt, params, **kw):
            return [t async for d in engine.generate(prompt, params, **kw) for t in d.token_ids]

        async def main():
            low = [
                asyncio.create_task(one(p, LOW, request_id=r))
                for r, p in (("a", "fair batching"), ("b", LONG_PROMPT), ("c", "tenants"))
            ]
            while core.scheduler.num_waiting or not core.scheduler.running:
                await asyncio.sleep(0.001)
            hold.set()
            await asyncio.to_thread(inside.wait, 10)
            high = await one(HIGH_PROMPT, HIGH, request_id="h", priority=10)
            out = await asyncio.gather(*low)
            await engine.shutdown()
            return out + [high]

        return asyncio.run(main()), core.num_interrupted_steps

    got, given_way = streams(True)
    ref, ref_given_way = streams(False)
    assert given_way == 1 and ref_given_way == 0
    assert got == ref and [len(t) for t in got] == [12, 12, 12, 6]
