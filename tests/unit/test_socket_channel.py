"""The channel's socket transport on loopback: frames arrive whole and in order, and nothing is
unpickled from a peer that has not proved it is the other end of the offer."""

from __future__ import annotations

import asyncio
import os
import pickle

import pytest

from fairbatch.deployments.cluster.socket_channel import (
    TOKEN_BYTES,
    ChannelServer,
    Offer,
    connect,
    read_messages,
    write_messages,
)

UNPICKLED: list[str] = []


def _mark(what: str) -> None:
    UNPICKLED.append(what)


class _Payload:
    """Unpickling this runs `_mark`: proof that a frame was unpickled."""

    def __reduce__(self):
        return (_mark, ("payload",))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_messages_arrive_whole_in_order_and_the_stream_ends_with_the_replicas_end():
    messages = [[{"i": i, "text": "é" * i}] * (i + 1) for i in range(50)] + [[b"x" * 300_000]]

    async def main():
        async def serve(consumer, reader, writer):
            assert consumer == "c1"

            async def source():
                for m in messages:
                    yield m

            await write_messages(source(), reader, writer)

        server = ChannelServer("127.0.0.1", serve)
        offer = await server.offer("c1")
        reader, writer = await connect(offer, 5)
        got = [m async for m in read_messages(reader, writer)]
        server.close()
        return got

    assert run(main()) == messages


def test_a_wrong_token_gets_no_answer_and_an_offer_is_good_once():
    async def main():
        served = []

        async def serve(consumer, reader, writer):
            served.append(consumer)

        server = ChannelServer("127.0.0.1", serve)
        offer = await server.offer("c1")
        forged = Offer(offer.host, offer.port, os.urandom(TOKEN_BYTES), offer.reply)
        with pytest.raises(ConnectionError):
            await connect(forged, 5)
        reader, writer = await connect(offer, 5)  # the real one still works, once
        writer.close()
        with pytest.raises(ConnectionError):
            await connect(offer, 5)
        await asyncio.sleep(0.05)
        server.close()
        return served

    assert run(main()) == ["c1"]


def test_nothing_is_unpickled_from_a_peer_that_does_not_answer_with_the_offers_reply():
    """Someone else listening at the offered address (the replica died, its port was taken):
    the consumer drops the connection at the handshake instead of unpickling its frames."""
    UNPICKLED.clear()

    async def main():
        async def impostor(reader, writer):
            await reader.readexactly(TOKEN_BYTES)
            data = pickle.dumps([_Payload()])
            writer.write(os.urandom(TOKEN_BYTES) + len(data).to_bytes(4, "big") + data)
            await writer.drain()

        server = await asyncio.start_server(impostor, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        offer = Offer("127.0.0.1", port, os.urandom(TOKEN_BYTES), os.urandom(TOKEN_BYTES))
        with pytest.raises(ConnectionError):
            await connect(offer, 5)
        server.close()

    run(main())
    assert UNPICKLED == []
    pickle.loads(pickle.dumps([_Payload()]))  # (the payload does mark when unpickled)
    assert UNPICKLED == ["payload"]


def test_the_consumer_closing_its_end_stops_the_replicas_writer_and_closes_its_source():
    async def main():
        closed = asyncio.Event()
        writer_done = asyncio.Event()

        async def serve(consumer, reader, writer):
            async def source():
                try:
                    while True:
                        yield ["tick"]
                        await asyncio.sleep(0.01)
                finally:
                    closed.set()

            try:
                await write_messages(source(), reader, writer)
            finally:
                writer_done.set()

        server = ChannelServer("127.0.0.1", serve)
        reader, writer = await connect(await server.offer("c"), 5)
        stream = read_messages(reader, writer)
        assert await stream.__anext__() == ["tick"]
        await stream.aclose()  # closes the connection
        await asyncio.wait_for(writer_done.wait(), 5)
        server.close()
        return closed.is_set()

    assert run(main())


def test_a_connection_cut_inside_a_frame_is_an_error_not_an_end():
    async def main():
        async def serve(consumer, reader, writer):
            data = pickle.dumps(["whole"])
            writer.write(len(data).to_bytes(4, "big") + data)
            writer.write((1000).to_bytes(4, "big") + b"half")
            await writer.drain()

        server = ChannelServer("127.0.0.1", serve)
        reader, writer = await connect(await server.offer("c"), 5)
        got = []
        with pytest.raises(ConnectionError, match="inside a frame"):
            async for m in read_messages(reader, writer):
                got.append(m)
        server.close()
        return got

    assert run(main()) == [["whole"]]


# ---- calls --------------------------------------------------------------------------------


def call_server(handlers: dict, writers: list | None = None):
    """A server answering `handlers`, and the `get_offer` a CallClient asks it with (each
    connection's writer goes to `writers`)."""
    from fairbatch.deployments.cluster.socket_channel import serve_calls

    async def serve(caller, reader, writer):
        if writers is not None:
            writers.append(writer)
        await serve_calls(handlers, reader, writer)

    server = ChannelServer("127.0.0.1", lambda *a: None)

    async def get_offer():
        return await server.offer("controller", serve)

    return server, get_offer


def test_calls_get_their_own_answers_and_a_raise_comes_back_as_call_failed():
    from fairbatch.deployments.cluster.socket_channel import CallClient, CallFailed

    started: list[int] = []

    async def main():
        async def echo(i, delay):
            started.append(i)
            await asyncio.sleep(delay)
            return i * 10

        async def boom():
            raise ValueError("no such request")

        server, offer = call_server({"echo": echo, "boom": boom})
        offers = []

        async def get_offer():
            offers.append(await offer())
            return offers[-1]

        client = CallClient(get_offer, 5)
        # answers out of order (later calls are quicker); each call gets its own
        got = await asyncio.gather(*(client.call("echo", i, 0.05 - i * 0.01) for i in range(5)))
        with pytest.raises(CallFailed, match="ValueError: no such request"):
            await client.call("boom")
        assert await client.call("echo", 7, 0) == 70  # the connection lives on after a raise
        client.close()
        server.close()
        return got, len(offers)

    got, connects = run(main())
    assert got == [0, 10, 20, 30, 40]
    assert started[:5] == [0, 1, 2, 3, 4]  # started in the order they were sent
    assert connects == 1  # one connection for all of them


def test_a_broken_connection_fails_its_calls_and_the_next_call_reconnects():
    from fairbatch.deployments.cluster.socket_channel import CallClient

    async def main():
        hold = asyncio.Event()
        writers = []

        async def wait():
            await hold.wait()
            return "late"

        async def hello():
            return "hello"

        server, get_offer = call_server({"wait": wait, "hello": hello}, writers)
        client = CallClient(get_offer, 5)
        pending = asyncio.ensure_future(client.call("wait"))
        await asyncio.sleep(0.1)
        writers[0].transport.abort()  # the peer's process died
        with pytest.raises(ConnectionError):
            await pending
        answer = await client.call("hello")  # a new connection
        client.close()
        server.close()
        return answer, len(writers)

    assert run(main()) == ("hello", 2)


def test_an_unreachable_socket_fails_at_once_until_it_is_tried_again():
    import time

    from fairbatch.deployments.cluster.socket_channel import CallClient

    async def main():
        asked = []

        async def get_offer():  # an offer whose port nothing listens on
            asked.append(time.monotonic())
            sock = __import__("socket").socket()
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            sock.close()
            return Offer("127.0.0.1", port, os.urandom(TOKEN_BYTES), os.urandom(TOKEN_BYTES))

        client = CallClient(get_offer, 1.0, retry_after_s=0.3)
        for _ in range(3):
            with pytest.raises((ConnectionError, OSError)):
                await client.call("hello")
        first = len(asked)
        await asyncio.sleep(0.35)
        with pytest.raises((ConnectionError, OSError)):
            await client.call("hello")
        return first, len(asked)

    assert run(main()) == (1, 2)  # one connect tried, then none until retry_after_s had passed


def test_a_call_runs_to_its_end_when_the_caller_goes_away():
    # (a submission cut off halfway would leave a request routed on the replica, never run)
    from fairbatch.deployments.cluster.socket_channel import CallClient

    async def main():
        hold, done = asyncio.Event(), asyncio.Event()

        async def slow():
            await hold.wait()
            done.set()
            return "late"

        server, get_offer = call_server({"slow": slow})
        client = CallClient(get_offer, 5)
        pending = asyncio.ensure_future(client.call("slow"))
        await asyncio.sleep(0.1)
        client.close()  # the caller goes away mid-call
        with pytest.raises((ConnectionError, asyncio.CancelledError)):
            await pending
        await asyncio.sleep(0.1)
        hold.set()
        await asyncio.wait_for(done.wait(), 5)  # the call still ran to its end
        server.close()
        return True

    assert run(main())
