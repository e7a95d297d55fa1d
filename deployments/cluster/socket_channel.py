"""A replica's channels, and the submissions to replicas and the controller, over TCP sockets
of their own beside Ray: the default data plane.

Measured on the 2-core machine (docs/BENCHMARKS.md, "The channel's transport"): through the
Serve app the ingress spends 0.11 CPU ms per output token with the socket and 0.20 with a Ray
streaming generator as the channel, and the app delivers 0.71x of offline tokens/s against
0.61x. Every Ray stream item (or actor call) costs both processes far more than the frame does.

Ray stays the control plane: the consumer asks the replica (`Replica.channel_socket`, an actor
call) for an `Offer` - the replica's address, a port, and two random tokens - and connects.
The consumer sends the first token; the replica checks it (single use, within `OFFER_TTL_S`)
before it reads anything else, and answers with the second, which the consumer checks before
it unpickles a frame. So only the two ends of one Ray call can talk on the socket. After that
the replica writes frames (a 4-byte length, then the pickled list of one message's items) and
reads nothing but the consumer's end of the connection.

The same servers take calls (`CallClient`, `serve_calls`, at the end): the controller's
forwarded submissions to a replica (`Replica.call_socket`) and a client's `submit_many` to the
controller (`Controller.call_socket`), each ~5 ms quicker than the actor call it replaces.

What cannot travel in a plain pickle stays on Ray: a `Moved` that names its destination (an
actor handle, and an ObjectRef whose borrowers Ray must track) goes as `MovePending`, and the
consumer fetches it with `Replica.moved`.

TCP keepalive probes find a peer whose machine vanished without closing the connection.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import pickle
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

TOKEN_BYTES = 16
OFFER_TTL_S = 60.0  # an offer not taken up by then is void
HANDSHAKE_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 5.0  # a socket not reached by then: its caller falls back to Ray
MAX_FRAME = 1 << 30
_LEN = 4


@dataclass(frozen=True)
class Offer:
    """Where and how a consumer connects to a replica's channel (sent over Ray)."""

    host: str
    port: int
    token: bytes  # the consumer sends this
    reply: bytes  # the replica answers with this


@dataclass(frozen=True)
class MovePending:
    """In a socket frame, in place of a `Moved` naming a replica: fetch it from the replica
    (`Replica.moved(request_id)`), where it waits."""

    request_id: str


def node_address() -> str:
    """The address other processes reach this one at: Ray's node address (loopback outside
    Ray)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:
        pass
    return "127.0.0.1"


def keepalive(sock: socket.socket | None) -> None:
    """Probe an idle connection after 10 s, every 5 s, and drop it after 3 unanswered."""
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def frame(items: list) -> bytes:
    data = pickle.dumps(items, protocol=5)
    return len(data).to_bytes(_LEN, "big") + data


class ChannelServer:
    """The replica's listening socket. `serve(consumer, reader, writer)` is called for each
    connection whose token matched an offer made to `consumer`."""

    def __init__(self, host: str, serve: Callable[[str, Any, Any], Any]) -> None:
        self.host = host
        self.serve = serve
        self.port = 0
        # token -> (consumer, reply, time made, what serves the connection)
        self._offers: dict[bytes, tuple[str, bytes, float, Callable]] = {}
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()

    async def offer(
        self, consumer: str, serve: Callable[[str, Any, Any], Any] | None = None
    ) -> Offer:
        """An offer to `consumer`, whose connection `serve` (default: the server's) handles."""
        if self._server is None:
            self._server = await asyncio.start_server(self._accept, self.host, 0)
            self.port = self._server.sockets[0].getsockname()[1]
            log.info("channel socket listening on %s:%d", self.host, self.port)
        now = time.monotonic()
        self._offers = {t: o for t, o in self._offers.items() if now - o[2] < OFFER_TTL_S}
        token, reply = os.urandom(TOKEN_BYTES), os.urandom(TOKEN_BYTES)
        self._offers[token] = (consumer, reply, now, serve or self.serve)
        return Offer(self.host, self.port, token, reply)

    def _claim(self, token: bytes) -> tuple[str, bytes, Callable] | None:
        for known in list(self._offers):
            if hmac.compare_digest(known, token):
                consumer, reply, made, serve = self._offers.pop(known)
                if time.monotonic() - made < OFFER_TTL_S:
                    return consumer, reply, serve
        return None

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            keepalive(writer.get_extra_info("socket"))
            try:
                token = await asyncio.wait_for(reader.readexactly(TOKEN_BYTES), HANDSHAKE_TIMEOUT_S)
            except (asyncio.IncompleteReadError, asyncio.TimeoutError, OSError):
                return
            claim = self._claim(token)
            if claim is None:
                log.warning("channel socket: a connection with no valid token, closed")
                return
            consumer, reply, serve = claim
            writer.write(reply)
            await serve(consumer, reader, writer)
        except (ConnectionError, OSError):
            pass  # the consumer went away
        finally:
            writer.close()
            if task is not None:
                self._tasks.discard(task)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in self._tasks:
            task.cancel()


async def write_messages(
    messages: AsyncIterator[list], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """Write each message as a frame until `messages` ends or the consumer closes its end
    (the consumer never sends after the handshake: anything it does is its end closing).
    A consumer that reads slower than the frames come waits in `drain()`; the messages pile
    up at their source meanwhile."""

    async def write() -> None:
        async for items in messages:
            writer.write(frame(items))
            await writer.drain()

    writing = asyncio.ensure_future(write())
    closed = asyncio.ensure_future(reader.read(1))
    try:
        await asyncio.wait({writing, closed}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (writing, closed):
            task.cancel()
        await asyncio.gather(writing, closed, return_exceptions=True)
        close = getattr(messages, "aclose", None)
        if close is not None:
            await close()
    if writing.done() and not writing.cancelled() and writing.exception() is not None:
        raise writing.exception()


async def connect(
    offer: Offer, timeout_s: float
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect to a replica's offer and check that it answers as that replica (read its
    frames with `read_messages`). OSError or asyncio.TimeoutError when it cannot."""

    async def handshake() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection(offer.host, offer.port, limit=1 << 20)
        keepalive(writer.get_extra_info("socket"))
        writer.write(offer.token)
        reply = await reader.readexactly(TOKEN_BYTES)
        if not hmac.compare_digest(reply, offer.reply):
            writer.close()
            raise ConnectionError(f"{offer.host}:{offer.port} is not the replica that offered it")
        return reader, writer

    try:
        return await asyncio.wait_for(handshake(), timeout_s)
    except asyncio.IncompleteReadError as e:
        raise ConnectionError(f"{offer.host}:{offer.port} closed during the handshake") from e


async def read_messages(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> AsyncIterator[list]:
    """The replica's messages, until it closes the connection between two frames (then this
    ends; ConnectionError inside one). Closing this iterator closes the connection."""
    try:
        while True:
            inside = False
            try:
                head = await reader.readexactly(_LEN)
                inside = True
                size = int.from_bytes(head, "big")
                if size > MAX_FRAME:
                    raise ConnectionError(f"a channel frame of {size} bytes: the stream is corrupt")
                data = await reader.readexactly(size)
            except asyncio.IncompleteReadError as e:
                if not inside and not e.partial:  # closed between two frames
                    return
                raise ConnectionError("the channel closed inside a frame") from None
            yield pickle.loads(data)
    finally:
        writer.close()


# ---- calls ---------------------------------------------------------------------------------
# The same sockets carry calls, where a Ray actor call would cost each end ~1.5 ms of CPU and
# ~3-6 ms of latency on the 2-core machine (docs/RELIABILITY.md): the controller's submissions
# to a replica, a client's to the controller. A call is a frame `(seq, name, args)`; its answer
# `(seq, True, result)` or `(seq, False, error text)`. Calls start in the order they arrive.


class CallFailed(Exception):
    """The peer ran the call and it raised (the text says what)."""


async def serve_calls(
    handlers: dict[str, Callable[..., Any]], reader: asyncio.StreamReader, writer: Any
) -> None:
    """Answer the calls on one connection with `handlers` (coroutine functions) until the
    caller closes it. A call runs to its end even if the caller goes away meanwhile (as an
    actor call would: a call cut off halfway could leave its work half done), and then its
    answer is dropped."""
    lock = asyncio.Lock()
    tasks: set[asyncio.Task] = set()  # (held: a task nobody references may be collected)

    async def run(seq: int, name: str, args: tuple) -> None:
        try:
            answer = (seq, True, await handlers[name](*args))
        except Exception as e:
            answer = (seq, False, f"{type(e).__name__}: {e}")
        try:
            data = frame(answer)
        except Exception as e:  # an answer that does not pickle: say so
            data = frame((seq, False, f"the answer does not pickle: {e!r}"))
        async with lock:
            if writer.is_closing():
                return
            try:
                writer.write(data)
                await writer.drain()
            except (ConnectionError, OSError):
                pass  # the caller went away

    async for seq, name, args in read_messages(reader, writer):
        task = asyncio.ensure_future(run(seq, name, args))
        tasks.add(task)
        task.add_done_callback(tasks.discard)


class CallClient:
    """Calls to one actor over its socket. `get_offer()` (a coroutine, over Ray) asks the
    actor for an offer; the connection opens on the first call and again after one broke.
    A call raises ConnectionError (or asyncio.TimeoutError) when the socket fails or cannot be
    reached; its caller then uses Ray. After a failed connect, calls fail at once for
    `retry_after_s` before the socket is tried again (a firewalled port costs one timeout,
    not one per call)."""

    def __init__(
        self,
        get_offer: Callable[[], Any],
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        retry_after_s: float = 30.0,
    ) -> None:
        self.get_offer = get_offer
        self.connect_timeout_s = connect_timeout_s
        self.retry_after_s = retry_after_s
        self._down_until = 0.0  # monotonic time before which no connect is tried
        self._seq = 0
        self._pending: dict[int, asyncio.Future] = {}
        self._writer: Any = None
        self._connecting: asyncio.Future | None = None
        self._reader_task: asyncio.Task | None = None

    async def call(self, name: str, *args: Any) -> Any:
        writer = await self._connection()
        self._seq += 1
        seq = self._seq
        fut = asyncio.get_running_loop().create_future()
        self._pending[seq] = fut
        try:
            writer.write(frame((seq, name, args)))
            await writer.drain()
            return await fut
        finally:
            self._pending.pop(seq, None)

    async def _connection(self) -> Any:
        if self._writer is not None:
            return self._writer
        if time.monotonic() < self._down_until:
            raise ConnectionError("the socket could not be reached; not tried again yet")
        if self._connecting is None:  # one connect for all the calls waiting on it
            self._connecting = asyncio.ensure_future(self._connect())
        try:
            return await asyncio.shield(self._connecting)
        finally:
            if self._connecting is not None and self._connecting.done():
                self._connecting = None

    async def _connect(self) -> Any:
        try:
            offer = await self.get_offer()
            reader, writer = await connect(offer, self.connect_timeout_s)
        except BaseException:
            self._down_until = time.monotonic() + self.retry_after_s
            raise
        self._writer = writer
        self._reader_task = asyncio.ensure_future(self._read(reader, writer))
        return writer

    async def _read(self, reader: asyncio.StreamReader, writer: Any) -> None:
        error: BaseException = ConnectionError("the peer closed the connection")
        try:
            async for seq, ok, result in read_messages(reader, writer):
                fut = self._pending.get(seq)
                if fut is not None and not fut.done():
                    if ok:
                        fut.set_result(result)
                    else:
                        fut.set_exception(CallFailed(result))
        except (ConnectionError, OSError) as e:
            error = ConnectionError(repr(e))
        finally:
            if self._writer is writer:
                self._writer = None
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(error)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._reader_task is not None:
            self._reader_task.cancel()
