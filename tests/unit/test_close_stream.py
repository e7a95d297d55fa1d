"""`close_stream`: a backend stream that another task is inside is left to that task (no
warning, and that task still closes it); a stream whose close fails is logged."""

import asyncio
import logging

from fairbatch.deployments.api.http import close_stream


def test_a_stream_another_task_is_inside_is_closed_by_that_task_without_a_warning(caplog):
    closed: list[str] = []
    gate = asyncio.Event()

    async def stream():
        try:
            yield 1
            await gate.wait()  # the reader is in here when the second closer comes
            yield 2
        finally:
            closed.append("stream")

    async def main():
        it = stream()
        assert await it.__anext__() == 1
        reader = asyncio.ensure_future(it.__anext__())
        await asyncio.sleep(0)  # the reader is inside the stream now
        await close_stream(it)  # finds it running: left to the reader
        assert closed == []
        reader.cancel()  # the reader leaves (as the coalescer's is cancelled), closing it
        await asyncio.gather(reader, return_exceptions=True)
        await close_stream(it)  # the reader's own closer: a no-op now
        return closed

    with caplog.at_level(logging.WARNING, logger="fairbatch.api"):
        assert asyncio.run(main()) == ["stream"]
    assert not caplog.records


def test_a_close_that_fails_is_logged(caplog):
    async def stream():
        try:
            yield 1
        finally:
            raise RuntimeError("the backend's cleanup failed")

    async def main():
        it = stream()
        await it.__anext__()
        await close_stream(it)

    with caplog.at_level(logging.WARNING, logger="fairbatch.api"):
        asyncio.run(main())
    assert [r.getMessage() for r in caplog.records] == ["closing a backend stream failed"]
