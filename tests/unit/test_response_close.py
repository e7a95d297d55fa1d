"""A response's backend stream is closed once, however many ways its end arrives.

`ResponseRun.close()` and the end of `ResponseRun.deltas()` both close the backend stream; the
backend's closing awaits (the cluster backend cancels the request upstream there). A second
`aclose()` while the first is still running used to fail with "asynchronous generator is
already running" (logged as "closing a backend stream failed").
"""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

from fairbatch.deployments.api.responses import ResponseRun


def _run(backend) -> ResponseRun:
    api = SimpleNamespace(
        registry=SimpleNamespace(release=lambda ticket: None),
        finish_log=lambda ticket, outcome: None,
    )
    ticket = SimpleNamespace(request_id="r1", created=0)
    return ResponseRun(api, ticket, backend, "first", chat=False, top_n=None)


def test_close_and_the_end_of_deltas_close_the_backend_once(caplog):
    closings: list[str] = []

    async def backend():
        try:
            yield "second"
            yield "third"
        finally:
            closings.append("start")
            await asyncio.sleep(0.01)  # as the cluster backend cancelling upstream
            closings.append("end")

    async def main() -> list[str]:
        run = _run(backend())
        deltas = run.deltas()
        got = [await deltas.__anext__(), await deltas.__anext__()]
        await asyncio.gather(run.close(), deltas.aclose())
        return got

    with caplog.at_level(logging.WARNING):
        got = asyncio.run(main())
    assert got == ["first", "second"]
    assert closings == ["start", "end"]  # once, to its end
    assert "closing a backend stream failed" not in caplog.text


def test_a_cancelled_closer_does_not_cut_the_backend_close_short():
    closings: list[str] = []

    async def backend():
        try:
            yield "second"
        finally:
            closings.append("start")
            await asyncio.sleep(0.05)
            closings.append("end")

    async def main() -> None:
        run = _run(backend())
        deltas = run.deltas()
        await deltas.__anext__()
        await deltas.__anext__()
        closer = asyncio.ensure_future(run.close())
        await asyncio.sleep(0.01)
        closer.cancel()  # the caller gives up waiting; the backend still closes
        await asyncio.sleep(0.1)

    asyncio.run(main())
    assert closings == ["start", "end"]
