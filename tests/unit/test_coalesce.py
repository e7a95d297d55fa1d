"""Stream coalescing at the ingress (`api.coalesce`): which deltas leave together, exactly."""

import asyncio

import pytest

from fairbatch.deployments.api.coalesce import coalesce
from fairbatch.engine.outputs import RequestDelta


def d(tokens, text, finished=False, reason=None, lps=None):
    return RequestDelta("r", list(tokens), text, finished, reason, lps)


async def gen(items, gate: asyncio.Event | None = None, gate_at: int = -1, closed=None):
    try:
        for i, item in enumerate(items):
            if i == gate_at:
                await gate.wait()
            if isinstance(item, Exception):
                raise item
            yield item
    finally:
        if closed is not None:
            closed.append(True)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


async def collect(it):
    return [x async for x in it]


def shape(chunks):
    return [(c.token_ids, c.text, c.finished) for c in chunks]


def test_interval_zero_sends_each_delta_but_holds_tokens_without_text():
    # token 2 ends inside a UTF-8 character: its text comes with token 3
    items = [d([1], "a", lps=["l1"]), d([2], "", lps=["l2"]), d([3], "é", lps=["l3"]),
             d([4], "b", True, "length", ["l4"])]  # fmt: skip
    chunks = run(collect(coalesce(gen(items), 0.0)))
    assert shape(chunks) == [([1], "a", False), ([2, 3], "é", False), ([4], "b", True)]
    assert chunks[1].logprobs == ["l2", "l3"]  # the records of the chunk's own tokens
    assert chunks[2].finish_reason == "length"


def test_what_has_arrived_leaves_with_the_first_delta_without_waiting():
    items = [d([i], str(i)) for i in range(5)] + [d([5], "5", True, "stop")]
    sleeps: list[float] = []

    async def sleep(w):
        sleeps.append(w)

    chunks = run(collect(coalesce(gen(items), 0.05, clock=lambda: 0.0, sleep=sleep)))
    assert shape(chunks) == [([0, 1, 2, 3, 4, 5], "012345", True)]
    assert sleeps == []  # the first chunk of a request never waits


async def fed(queue: asyncio.Queue):
    while (item := await queue.get()) is not None:
        yield item


def test_deltas_within_the_interval_merge_and_one_after_a_pause_leaves_at_once():
    t = [0.0]
    sleeps: list[float] = []

    async def sleep(w):
        sleeps.append(w)
        t[0] += w

    async def main():
        q: asyncio.Queue = asyncio.Queue()
        q.put_nowait(d([0], "0"))
        out = []
        async for c in coalesce(fed(q), 0.05, clock=lambda: t[0], sleep=sleep):
            out.append(c)
            if len(out) == 1:  # two more arrive right after the first chunk left
                q.put_nowait(d([1], "1"))
                q.put_nowait(d([2], "2"))
            elif len(out) == 2:  # a pause longer than the interval, then the last one
                t[0] += 1.0
                q.put_nowait(d([3], "3", True, "stop"))
                q.put_nowait(None)
        return out

    chunks = run(main())
    # 0 at once; 1 and 2 came within the interval: one chunk, sent once the interval since
    # the last chunk was over; 3 came after a pause: at once
    assert shape(chunks) == [([0], "0", False), ([1, 2], "12", False), ([3], "3", True)]
    assert sleeps == [pytest.approx(0.05)]


@pytest.mark.parametrize("interval", [0.0, 0.05])
def test_an_error_is_raised_after_the_deltas_before_it(interval):
    items = [d([1], "a"), d([2], "b"), RuntimeError("backend failed")]
    got = []

    async def main():
        with pytest.raises(RuntimeError, match="backend failed"):
            async for c in coalesce(gen(items), interval, clock=lambda: 0.0):
                got.append(c)

    run(main())
    assert [t for c in got for t in c.token_ids] == [1, 2]


def test_closing_stops_reading_the_backend():
    closed: list[bool] = []
    gate = asyncio.Event()  # never set: the backend waits for a token forever

    async def main():
        it = coalesce(gen([d([1], "a"), d([2], "b")], gate, 1, closed), 0.05)
        first = await it.__anext__()
        await it.aclose()
        return first

    assert run(main()).token_ids == [1]
    assert closed == [True]  # the read in progress was cancelled, the backend's finally ran


@pytest.mark.parametrize(
    "interval,want",
    [
        (0.0, [([1], "a", False), ([2], "b", False), ([], "", True)]),
        (0.05, [([1, 2], "ab", False), ([], "", True)]),  # all there at once: merged
    ],
)
def test_a_failed_ending_is_not_merged_into_the_text_before_it(interval, want):
    items = [d([1], "a"), d([2], "b"), d([], "", True, "abort")]
    chunks = run(collect(coalesce(gen(items), interval, clock=lambda: 0.0)))
    assert shape(chunks) == want  # the text still reaches the client, then the failure
    assert chunks[-1].finish_reason == "abort"


def test_a_reader_whose_cancel_is_swallowed_still_stops_and_closes_the_backend():
    closed: list[bool] = []
    produced: list[int] = []

    async def stubborn():  # swallows a cancellation, as asyncio.wait_for can on Python 3.11
        try:
            for i in range(1000):
                try:
                    await asyncio.sleep(0.001)
                except asyncio.CancelledError:
                    pass
                produced.append(i)
                yield d([i], str(i))
        finally:
            closed.append(True)

    async def main():
        it = coalesce(stubborn(), 0.05)
        await it.__anext__()
        await it.aclose()
        for _ in range(100):
            if closed:
                break
            await asyncio.sleep(0.01)

    run(main())
    assert closed == [True]  # closed by the reader itself: the request is aborted
    assert len(produced) < 50  # not read to its end


def test_a_merged_first_delta_keeps_the_prompt_logprobs_and_cached_count():
    first = d([5], "")  # text held back: merged with the next
    first.prompt_logprobs, first.num_cached_tokens = [None, [(3, -1.5)]], 16
    later = d([6], "ab")
    later.num_cached_tokens = None
    out = run(collect(coalesce(gen([first, later, d([], "", True, "length")]), 0)))
    assert out[0].token_ids == [5, 6] and out[0].text == "ab"
    assert out[0].prompt_logprobs == [None, [(3, -1.5)]] and out[0].num_cached_tokens == 16
    assert all(c.prompt_logprobs is None for c in out[1:])
