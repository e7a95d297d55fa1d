"""AsyncEngine: concurrent streams equal the offline results; a closed stream frees its blocks;
a failed step ends every stream; the steps run ahead of a busy event loop, within a bound;
shutdown and interpreter exit stop the engine thread; `build` makes the engine on the thread
that steps it."""

import asyncio
import subprocess
import sys
import threading
import time

import pytest

from fairbatch.engine import LLM, SamplingParams
from fairbatch.engine.async_engine import AsyncEngine, EngineDeadError
from fairbatch.engine.llm import build_engine

PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = ["fair batching", "paged attention keeps blocks", "tenants", "a b c d e f g"]


def test_concurrent_streams_match_offline():
    ref = [o.token_ids for o in LLM("tiny", num_gpu_blocks=128).generate(PROMPTS, PARAMS)]

    async def main():
        engine = AsyncEngine(build_engine("tiny", num_gpu_blocks=128))

        async def one(p):
            tokens, text, last = [], "", None
            async for d in engine.generate(p, PARAMS):
                tokens += d.token_ids
                text += d.text
                last = d
            return tokens, text, last

        results = await asyncio.gather(*(one(p) for p in PROMPTS))
        await engine.shutdown()
        return engine, results

    engine, results = asyncio.run(main())
    assert [r[0] for r in results] == ref
    assert all(r[2].finished and r[2].finish_reason == "length" for r in results)
    tok = engine.engine.tokenizer
    assert [r[1] for r in results] == [tok.decode(t) for t in ref]
    assert engine.engine.scheduler.kv.all_free()


def test_build_makes_the_engine_on_the_thread_that_steps_it():
    ref = LLM("tiny", num_gpu_blocks=128).generate(PROMPTS[0], PARAMS)[0].token_ids
    built_on, stepped_on = [], set()

    def factory():
        built_on.append(threading.get_ident())
        return build_engine("tiny", num_gpu_blocks=128)

    async def main():
        engine = AsyncEngine.build(factory, step_hook=lambda: stepped_on.add(threading.get_ident()))
        tokens = [t async for d in engine.generate(PROMPTS[0], PARAMS) for t in d.token_ids]
        await engine.shutdown()
        return tokens

    assert asyncio.run(main()) == ref
    assert len(built_on) == 1 and built_on[0] != threading.get_ident()
    assert stepped_on == set(built_on)


def test_build_raises_what_the_factory_raises_and_leaves_no_thread():
    def factory():
        raise ValueError("no such model")

    before = threading.active_count()
    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine.build(factory)
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() == before


def test_closing_a_stream_aborts_and_frees():
    async def main():
        engine = AsyncEngine(build_engine("tiny", num_gpu_blocks=128))
        long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
        stream = engine.generate("a long request", long)
        got = 0
        async for _ in stream:
            got += 1
            if got == 3:
                break
        await stream.aclose()
        await asyncio.sleep(0.05)
        core = engine.engine
        left = await engine.call(lambda: (core.has_unfinished(), core.scheduler.kv.all_free()))
        await engine.shutdown()
        return left

    assert asyncio.run(main()) == (False, True)


def test_bad_request_raises_and_engine_keeps_serving():
    async def main():
        engine = AsyncEngine(build_engine("tiny", num_gpu_blocks=128))
        with pytest.raises(ValueError, match="empty"):
            async for _ in engine.generate([], PARAMS):
                pass
        out = [d async for d in engine.generate("still alive", PARAMS)]
        await engine.shutdown()
        return out

    out = asyncio.run(main())
    assert out[-1].finished and sum(len(d.token_ids) for d in out) == 10


def test_a_failed_step_ends_every_stream_and_calls_still_run():
    """A step that raises ends every open stream with EngineDeadError, reaches the sink once,
    and refuses new requests; calls (aborts, stats) still run and shutdown returns."""
    sunk: list = []

    async def main():
        core = build_engine("tiny", num_gpu_blocks=128)
        step, steps = core.step, [0]

        def failing_step():
            steps[0] += 1
            if steps[0] == 4:
                raise RuntimeError("the device fell off")
            return step()

        core.step = failing_step  # type: ignore[method-assign]
        engine = AsyncEngine(core, sink=sunk.append)

        async def one(prompt):
            got = []
            with pytest.raises(EngineDeadError, match="fell off"):
                async for d in engine.generate(prompt, PARAMS):
                    got += d.token_ids
            return got

        got = await asyncio.gather(*(one(p) for p in PROMPTS[:2]))
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate("after", PARAMS):
                pass
        still = await asyncio.wait_for(engine.call(lambda: "called"), 5)
        await asyncio.wait_for(engine.shutdown(), 5)
        return got, still

    ref = [o.token_ids for o in LLM("tiny", num_gpu_blocks=128).generate(PROMPTS[:2], PARAMS)]
    got, still = asyncio.run(main())
    # the first request ran in steps 1-3; the second was added before step 2 at the latest
    assert len(got[0]) == 3 and len(got[1]) in (2, 3) and still == "called"
    assert [r[: len(g)] for r, g in zip(ref, got)] == got
    assert len(sunk) == 1 and "fell off" in str(sunk[0])


def test_steps_run_ahead_of_a_busy_event_loop_by_at_most_the_bound():
    """The step loop runs on the engine thread: while the event loop is busy (here: blocked
    for 0.3 s), the engine goes on stepping - exactly MAX_UNDELIVERED_STEPS steps past the last
    one the event loop handed out, then waits for it. The tokens stay the offline ones."""
    long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    ref = LLM("tiny", num_gpu_blocks=128).generate(["run ahead"], long)[0].token_ids

    async def main():
        engine = AsyncEngine(
            build_engine("tiny", num_gpu_blocks=128), step_hook=lambda: time.sleep(0.002)
        )
        tokens, ahead = [], []
        async for d in engine.generate("run ahead", long):
            tokens += d.token_ids
            if len(tokens) in (5, 20, 40):
                time.sleep(0.3)  # the event loop blocked: nothing is delivered meanwhile
                ahead.append(engine.num_steps - engine.delivered_step)
        await engine.shutdown()
        return tokens, ahead

    tokens, ahead = asyncio.run(main())
    assert tokens == ref
    assert ahead == [AsyncEngine.MAX_UNDELIVERED_STEPS] * 3


def test_shutdown_ends_open_streams_and_later_calls_fail():
    async def main():
        engine = AsyncEngine(
            build_engine("tiny", num_gpu_blocks=128), step_hook=lambda: time.sleep(0.002)
        )
        long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
        got = []

        async def stream():
            with pytest.raises(EngineDeadError, match="shut down"):
                async for d in engine.generate("a long request", long):
                    got.extend(d.token_ids)

        task = asyncio.ensure_future(stream())
        while len(got) < 3:
            await asyncio.sleep(0.01)
        await asyncio.wait_for(engine.shutdown(), 5)
        await asyncio.wait_for(task, 5)
        with pytest.raises(EngineDeadError, match="shut down"):
            await engine.call(lambda: "too late")
        return len(got)

    assert 3 <= asyncio.run(main()) < 500


def test_an_engine_left_running_does_not_hold_the_interpreter_at_exit():
    """A process that returns with a request still stepping exits (the engine thread stops at
    interpreter exit, after its step), and cleanly."""
    code = (
        "import asyncio\n"
        "from fairbatch.engine import SamplingParams\n"
        "from fairbatch.engine.async_engine import AsyncEngine\n"
        "from fairbatch.engine.llm import build_engine\n"
        "async def main():\n"
        "    engine = AsyncEngine(build_engine('tiny', num_gpu_blocks=128))\n"
        "    p = SamplingParams(temperature=0, max_tokens=100000, ignore_eos=True)\n"
        "    stream = engine.generate('never ends', p)\n"
        "    await stream.__anext__()\n"
        "    print('streaming', flush=True)\n"
        "loop = asyncio.new_event_loop()\n"
        "loop.run_until_complete(main())\n"  # the loop stays open: the engine can post to it
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "streaming\n"
