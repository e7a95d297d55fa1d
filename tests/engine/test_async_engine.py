"""AsyncEngine: concurrent streams equal the offline results; a closed stream frees its blocks;
a failed step ends every stream."""

import asyncio
import os
import sys
import threading

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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux")
def test_engine_thread_runs_below_its_process():
    """`thread_niceness`: the engine thread (steps, adds) runs that many nice levels below the
    process; the event loop's thread keeps the process's."""

    def nice_of_this_thread() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    async def main():
        engine = AsyncEngine(build_engine("tiny", num_gpu_blocks=32), thread_niceness=3)
        inside = await engine.call(nice_of_this_thread)
        tokens = [t async for d in engine.generate("tenants", PARAMS) for t in d.token_ids]
        await engine.shutdown()
        return inside, nice_of_this_thread(), tokens

    if os.getpriority(os.PRIO_PROCESS, 0) > 16:
        pytest.skip("this process runs too low to go 3 levels lower")
    inside, outside, tokens = asyncio.run(main())
    assert inside == outside + 3 and len(tokens) == 10


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
