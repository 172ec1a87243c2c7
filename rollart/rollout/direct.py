"""The direct turn path: an env member asks a generation member over a TCP connection, no broker hop.

Over the bus a turn is two produce/fetch round trips (``gen.requests.<pool>`` then ``env.actions``);
in Python on a small machine those cost more CPU and time than a short generation itself (README,
"Loop throughput"). With ``generation.transport: direct`` each generation member also serves its
stage's handler on a TCP socket and advertises the address (``tcp://host:port``) in the pool
registry; env members keep one connection per member. The messages are the bus's own (the codec's
msgpack values, with their schema version), framed by :class:`Frames`.

The connections are asyncio's own transports, read and written by the event loop that handles the
turns: a message is one ``send`` and one wake-up of the peer. ZeroMQ (this path's transport until
2026-12-06) hands every message to an I/O thread on each side, two more thread wake-ups per message;
on 2 cores a round trip cost 2-2.5x the CPU and 1.8-3x the time (README, "How a rollout flows").

What stays on the bus: the trajectory records (``trajectories.completed``, the durable and replayable
record of every turn's tokens, logprobs and versions), rewards, versions, and every turn for which no
member can be reached directly: a pool whose members do not serve the direct path, a member that went
away (its connection dropped or fell silent: the turn is re-sent to another member, ``attempt + 1``,
else over the bus), a handler error (the bus then dead-letters it as before). Routing is sticky per
trajectory (its turns go to one member while that member is up, for the engine's prefix cache).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Sequence
from urllib.parse import urlsplit
from zlib import crc32

from prometheus_client import Counter

from rollart.messages import DEFAULT_CODEC, Abort, GenerationRequest, GenerationResult
from rollart.messages.codec import H_SCHEMA, Codec
from rollart.rollout.replies import Delivery
from rollart.timeouts import wait_for

log = logging.getLogger(__name__)

DIRECT_INFO_KEY = "direct"  # the member's address in its pool registry info
OK, FAILED, GONE = b"ok", b"error", b"aborted"  # reply statuses
REQUEST, CANCEL = b"request", b"abort"  # request kinds
PING, PONG = b"ping", b"pong"  # a one-part frame: the client's heartbeat, and the member's answer

DIRECT_TURNS = Counter("rollart_generation_direct_requests_total",
                       "Requests served on the direct path, by outcome", ("job", "pool", "outcome"))


def advertised_host(bind_host: str, advertise: str | None) -> str:
    """The host others connect to: ``advertise`` if set, else the bind host, else (bound to every
    interface) this host's name."""
    if advertise:
        return advertise
    return socket.gethostname() if bind_host in ("0.0.0.0", "*", "::") else bind_host


class FrameError(ValueError):
    """The peer sent what is not a frame: the connection is dropped."""


class Frames:
    """A message of byte parts as one frame: its length, the number of parts, each part's length, the
    parts. ``feed`` takes what the socket read and returns the frames it completed."""

    HEAD = struct.Struct(">IB")  # the bytes after these 4, the number of parts
    MAX_BYTES = 256 << 20  # a frame longer than this is an error, not an allocation

    def __init__(self) -> None:
        self._buffer = bytearray()

    @classmethod
    def pack(cls, parts: Sequence[bytes]) -> bytes:
        lengths = struct.pack(f">{len(parts)}I", *map(len, parts))
        body = 1 + len(lengths) + sum(map(len, parts))
        return b"".join((cls.HEAD.pack(body, len(parts)), lengths, *parts))

    def feed(self, data: bytes) -> list[list[bytes]]:
        buffer = self._buffer
        buffer += data
        frames, at = [], 0
        while len(buffer) - at >= self.HEAD.size:
            body, count = self.HEAD.unpack_from(buffer, at)
            if body > self.MAX_BYTES or body < 1 + 4 * count:
                raise FrameError(f"a frame of {body} bytes and {count} parts")
            end = at + 4 + body
            if len(buffer) < end:
                break
            lengths = struct.unpack_from(f">{count}I", buffer, at + self.HEAD.size)
            if sum(lengths) != body - 1 - 4 * count:
                raise FrameError(f"parts of {sum(lengths)} bytes in a frame of {body}")
            start, parts = at + self.HEAD.size + 4 * count, []
            for length in lengths:
                parts.append(bytes(buffer[start:start + length]))
                start += length
            frames.append(parts)
            at = end
        del buffer[:at]
        return frames


class _Connection(asyncio.Protocol):
    """One TCP connection carrying frames: ``on_frames`` gets each read's complete frames."""

    def __init__(self, on_frames: Callable[["_Connection", list[list[bytes]]], None]):
        self.on_frames = on_frames
        self.frames = Frames()
        self.transport: asyncio.Transport | None = None
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.last_received = time.monotonic()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # a vanished peer is found in the end

    def data_received(self, data: bytes) -> None:
        self.last_received = time.monotonic()
        try:
            frames = self.frames.feed(data)
        except FrameError as exc:
            log.warning("direct: dropped a connection that sent %s", exc)
            self.abort()
            return
        if frames:
            self.on_frames(self, frames)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)

    @property
    def open(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def send(self, parts: Sequence[bytes]) -> bool:
        """Write the frame; False when the connection is gone (nothing is queued for it)."""
        if not self.open:
            return False
        assert self.transport is not None
        self.transport.write(Frames.pack(parts))
        return True

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()  # what is written still goes out

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


def _listening_socket(bind_host: str, port: int) -> socket.socket:
    host = None if bind_host in ("*", "") else bind_host
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.listen(128)
    sock.setblocking(False)
    return sock


# -- the generation member's side ------------------------------------------------------------------

Serve = Callable[[GenerationRequest], Awaitable[GenerationResult | None]]
CancelTurn = Callable[[Abort], Awaitable[object]]


class DirectServer:
    """Serves ``serve`` on a listening TCP socket (bound here, so the address is known before ``run``),
    up to ``max_in_flight`` requests at once. A service of the generation member: ``stop`` ends taking
    requests (a request arriving after it is answered "aborted", and its client asks elsewhere); ``run``
    returns once those in flight are answered, and closes every connection."""

    def __init__(self, serve: Serve, cancel: CancelTurn, *, bind_host: str, port: int, advertise: str | None,
                 max_in_flight: int, labels: tuple[str, str], codec: Codec = DEFAULT_CODEC):
        self.serve, self.cancel, self.codec, self.labels = serve, cancel, codec, labels
        self.socket = _listening_socket(bind_host, port)
        port = self.socket.getsockname()[1]
        host = advertised_host(bind_host, advertise)
        self.address = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
        self.slots = asyncio.Semaphore(max_in_flight)
        self.tasks: set[asyncio.Task[None]] = set()
        self.connections: set[_Connection] = set()
        self._stopped = asyncio.Event()

    def stop(self) -> None:
        self._stopped.set()

    async def run(self) -> None:
        server = await asyncio.get_running_loop().create_server(self._connection, sock=self.socket)
        try:
            await self._stopped.wait()
            server.close()  # no new connections
            if self.tasks:
                await asyncio.wait(self.tasks)
        finally:
            server.close()
            for task in self.tasks:
                task.cancel()
            for connection in list(self.connections):
                connection.close()  # the last replies go out first

    def _connection(self) -> _Connection:
        connection = _Connection(self._received)
        self.connections.add(connection)
        connection.closed.add_done_callback(lambda _: self.connections.discard(connection))
        return connection

    def _received(self, connection: _Connection, frames: list[list[bytes]]) -> None:
        for parts in frames:
            if parts == [PING]:
                connection.send([PONG])
            elif len(parts) != 4:
                log.warning("direct: dropped a request of %d parts", len(parts))
            elif parts[1] == CANCEL:
                self._spawn(self._cancel(parts[2], parts[3]))
            elif self._stopped.is_set():
                connection.send([parts[0], GONE, b"", b""])
            else:
                request_id, _, schema, value = parts
                self._spawn(self._answer(connection, request_id, schema, value))

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _cancel(self, schema: bytes, value: bytes) -> None:
        with contextlib.suppress(Exception):
            await self.cancel(self.codec.decode(value, [(H_SCHEMA, schema)], accept=(Abort,)).message)

    async def call(self, request: GenerationRequest) -> GenerationResult | None:
        """A request from a client in this process, without a socket: its result, None when it was
        aborted or this server stopped; the handler's error is raised."""
        if self._stopped.is_set():
            return None
        async with self.slots:
            try:
                result = await self.serve(request)
            except Exception:
                DIRECT_TURNS.labels(*self.labels, "error").inc()
                raise
        DIRECT_TURNS.labels(*self.labels, "aborted" if result is None else "ok").inc()
        return result

    async def _answer(self, connection: _Connection, request_id: bytes, schema: bytes, value: bytes) -> None:
        async with self.slots:
            try:
                request = self.codec.decode(value, [(H_SCHEMA, schema)], accept=(GenerationRequest,)).message
                result = await self.serve(request)
            except Exception as exc:  # noqa: BLE001 - the client falls back to the bus, which dead-letters it
                DIRECT_TURNS.labels(*self.labels, "error").inc()
                self._reply(connection, [request_id, FAILED, b"", f"{type(exc).__name__}: {exc}".encode()])
                return
        DIRECT_TURNS.labels(*self.labels, "aborted" if result is None else "ok").inc()
        if result is None:
            self._reply(connection, [request_id, GONE, b"", b""])
        else:
            self._reply(connection, [request_id, OK, self.codec.schema(result), self.codec.encode_value(result)])

    @staticmethod
    def _reply(connection: _Connection, parts: list[bytes]) -> None:
        if not connection.send(parts):  # the client went away: nobody waits for this
            log.info("direct: reply to a gone client dropped")


# -- the env member's side -------------------------------------------------------------------------


class _Reissue(Exception):
    """The member a request was sent to disconnected."""


class _Failed(Exception):
    """The member answered with an error."""


@dataclass
class _Peer:
    """One generation member: its connection (kept up by ``task``), its pending requests."""

    address: str
    up: asyncio.Event = field(default_factory=asyncio.Event)
    connection: _Connection | None = None
    pending: dict[bytes, asyncio.Future[tuple[bytes, bytes, bytes, float]]] = field(default_factory=dict)
    task: asyncio.Task[None] | None = None
    given_up_at: float = 0.0  # when a connect last timed out (not tried again for a while)

    def fail_pending(self) -> None:
        for future in self.pending.values():
            if not future.done():
                future.set_exception(_Reissue())

    def received(self, _: _Connection, frames: list[list[bytes]]) -> None:
        arrived = time.perf_counter()  # one read's results arrived together
        for parts in frames:
            future = self.pending.get(parts[0]) if len(parts) == 4 else None
            if future is not None and not future.done():
                future.set_result((parts[1], parts[2], parts[3], arrived))


class DirectClient:
    """The env member's side: ``request`` sends a turn to a member of the pool and waits for its result.
    Each member's connection is kept up in the background (re-connected 0.1-2 s after it drops) and
    pinged every ``heartbeat_ms``: one silent for three of them counts as dropped."""

    CONNECT_TIMEOUT_S = 2.0
    RETRY_CONNECT_AFTER_S = 10.0
    RECONNECT_S = (0.1, 2.0)  # the first and the longest wait between attempts to connect

    def __init__(self, *, timeout_s: float, codec: Codec = DEFAULT_CODEC, heartbeat_ms: int = 1000):
        self.timeout_s = timeout_s
        self.codec = codec
        self.heartbeat_s = heartbeat_ms / 1000
        self.peers: dict[str, _Peer] = {}
        self._ids = itertools.count()
        self.here: DirectServer | None = None  # a member in this process (see :meth:`serve_here`)

    def serve_here(self, server: DirectServer) -> None:
        """Turns for ``server``'s member go to it as a function call (an env member co-located with it,
        :mod:`rollart.stages.envgen`): no socket, frame or codec, and no second event loop to wake, which
        is what a turn between two processes costs. Its trajectories all go to it while it serves; other
        members are asked over their sockets as before."""
        self.here = server

    async def request(self, addresses: list[str], build: Callable[[int], GenerationRequest],
                      *, first_attempt: int = 0) -> tuple[Delivery | None, int]:
        """Send ``build(attempt)`` to the trajectory's member among ``addresses`` and wait for its result.
        Returns (result and when it arrived, next attempt); None when no member could answer (the caller
        then sends attempt ``next attempt`` over the bus). TimeoutError after ``timeout_s``."""
        attempt, tried = first_attempt, set()
        while True:
            request = build(attempt)
            here = self.here
            if here is not None and here.address in addresses and here.address not in tried:  # preferred
                try:
                    return await self._call_here(here, request), attempt + 1
                except _Reissue:
                    tried.add(here.address)
                except _Failed as exc:
                    log.info("%s: direct request failed in this process (%s); sending it over the bus",
                             request.traj_id, exc)
                    return None, attempt + 1
                attempt += 1
                continue
            peer = await self._peer_for(request.traj_id, [a for a in addresses if a not in tried])
            if peer is None:
                return None, attempt
            try:
                return await self._exchange(peer, request), attempt + 1
            except _Reissue:
                tried.add(peer.address)
            except _Failed as exc:
                log.info("%s: direct request failed at %s (%s); sending it over the bus", request.traj_id,
                         peer.address, exc)
                return None, attempt + 1
            attempt += 1

    async def _exchange(self, peer: _Peer, request: GenerationRequest) -> Delivery:
        request_id = next(self._ids).to_bytes(8, "big")
        future: asyncio.Future[tuple[bytes, bytes, bytes, float]] = asyncio.get_running_loop().create_future()
        peer.pending[request_id] = future
        try:
            if peer.connection is None or not peer.connection.send(
                    [request_id, REQUEST, self.codec.schema(request), self.codec.encode_value(request)]):
                raise _Reissue()  # dropped since it was chosen: nothing was sent
            status, schema, payload, arrived = await wait_for(future, self.timeout_s)
        except asyncio.TimeoutError:
            self._cancel(peer, request)
            raise
        except asyncio.CancelledError:
            self._cancel(peer, request)
            raise
        finally:
            peer.pending.pop(request_id, None)
        if status == OK:
            result: GenerationResult = self.codec.decode(payload, [(H_SCHEMA, schema)],
                                                         accept=(GenerationResult,)).message
            return Delivery(result, arrived)
        if status == GONE:
            raise _Reissue()  # aborted at the member though this env still waits: ask again
        raise _Failed(payload.decode(errors="replace"))

    async def _call_here(self, server: DirectServer, request: GenerationRequest) -> Delivery:
        try:
            result = await wait_for(server.call(request), self.timeout_s)
        except asyncio.TimeoutError:
            raise  # the call was cancelled, and the engine's request with it
        except Exception as exc:  # noqa: BLE001 - as a member's error reply: the bus dead-letters it
            raise _Failed(f"{type(exc).__name__}: {exc}") from exc
        if result is None:
            raise _Reissue()
        return Delivery(result, time.perf_counter())

    def _cancel(self, peer: _Peer, request: GenerationRequest) -> None:
        """Best effort: tell the member's engine to stop the request."""
        abort = request.cancellation()
        if peer.connection is not None:
            peer.connection.send([b"", CANCEL, self.codec.schema(abort), self.codec.encode_value(abort)])

    async def _peer_for(self, traj_id: str, addresses: list[str]) -> _Peer | None:
        """The trajectory's member (sticky: a hash of its id over the sorted addresses), skipping those
        whose connection is down; None if none connects within ``CONNECT_TIMEOUT_S``."""
        candidates = sorted(addresses)
        while candidates:
            address = candidates[crc32(traj_id.encode()) % len(candidates)]
            peer = self._peer(address)
            if peer.up.is_set():
                return peer
            if time.monotonic() - peer.given_up_at > self.RETRY_CONNECT_AFTER_S:
                try:
                    await wait_for(peer.up.wait(), self.CONNECT_TIMEOUT_S)
                    return peer
                except asyncio.TimeoutError:
                    peer.given_up_at = time.monotonic()
            candidates.remove(address)
        return None

    def _peer(self, address: str) -> _Peer:
        peer = self.peers.get(address)
        if peer is None:
            peer = self.peers[address] = _Peer(address)
            peer.task = asyncio.create_task(self._keep_connected(peer))
        return peer

    async def _keep_connected(self, peer: _Peer) -> None:
        """Connect, serve the connection until it drops or falls silent, wait, connect again."""
        split = urlsplit(peer.address)
        if split.scheme != "tcp" or not split.hostname or not split.port:
            log.warning("direct: %r is not a tcp://host:port address; its member is skipped", peer.address)
            return
        host, port = split.hostname, split.port
        wait = self.RECONNECT_S[0]
        loop = asyncio.get_running_loop()
        while True:
            try:
                _, connection = await loop.create_connection(lambda: _Connection(peer.received), host, port)
            except OSError:
                await asyncio.sleep(wait)
                wait = min(2 * wait, self.RECONNECT_S[1])
                continue
            wait = self.RECONNECT_S[0]
            peer.connection, peer.given_up_at = connection, 0.0
            peer.up.set()
            try:
                await self._heartbeat(connection)
            finally:
                peer.up.clear()
                peer.connection = None
                connection.abort()
                peer.fail_pending()
            await asyncio.sleep(wait)

    async def _heartbeat(self, connection: _Connection) -> None:
        """Ping every ``heartbeat_s`` until the connection drops, or has been silent for three."""
        while not connection.closed.done():
            await asyncio.wait([connection.closed], timeout=self.heartbeat_s)
            if time.monotonic() - connection.last_received > 3 * self.heartbeat_s:
                log.info("direct: a member silent for %.1f s counts as gone", 3 * self.heartbeat_s)
                return
            connection.send([PING])

    async def retain(self, live: set[str]) -> None:
        """Close the connections of members no longer live (restarted members come back on new
        addresses: without this a long run with restarts would keep a connection per address it saw)."""
        for address in [a for a, peer in self.peers.items() if a not in live and not peer.pending]:
            await self._close_peer(self.peers.pop(address))

    @staticmethod
    async def _close_peer(peer: _Peer) -> None:
        if peer.task is not None:
            peer.task.cancel()
            await asyncio.gather(peer.task, return_exceptions=True)
        peer.fail_pending()

    async def close(self) -> None:
        for peer in self.peers.values():
            await self._close_peer(peer)
        self.peers.clear()
