"""The direct turn path: an env member asks a generation member over a ZeroMQ socket, no broker hop.

Over the bus a turn is two produce/fetch round trips (``gen.requests.<pool>`` then ``env.actions``);
in Python on a small machine those cost more CPU and time than a short generation itself (README,
"Loop throughput"). With ``generation.transport: direct`` each generation member also serves its
stage's handler on a ZeroMQ ROUTER socket (the transport vLLM itself uses between its processes) and
advertises the address in the pool registry; env members keep one DEALER per member. The messages are
the bus's own (the codec's msgpack values, with their schema version).

What stays on the bus: the trajectory records (``trajectories.completed``, the durable and replayable
record of every turn's tokens, logprobs and versions), rewards, versions, and every turn for which no
member can be reached directly: a pool whose members do not serve the direct path, a member that went
away (its socket disconnected: the turn is re-sent to another member, ``attempt + 1``, else over the
bus), a handler error (the bus then dead-letters it as before). Routing is sticky per trajectory (its
turns go to one member while that member is up, for the engine's prefix cache).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable
from zlib import crc32

import zmq
import zmq.asyncio
from prometheus_client import Counter
from zmq.utils.monitor import parse_monitor_message

from rollart.messages import DEFAULT_CODEC, Abort, GenerationRequest, GenerationResult
from rollart.messages.codec import H_SCHEMA, Codec
from rollart.rollout.replies import Delivery

log = logging.getLogger(__name__)

DIRECT_INFO_KEY = "direct"  # the member's address in its pool registry info
OK, FAILED, GONE = b"ok", b"error", b"aborted"  # reply statuses
REQUEST, CANCEL = b"request", b"abort"  # request kinds

DIRECT_TURNS = Counter("rollart_generation_direct_requests_total",
                       "Requests served on the direct path, by outcome", ("job", "pool", "outcome"))


def advertised_host(bind_host: str, advertise: str | None) -> str:
    """The host others connect to: ``advertise`` if set, else the bind host, else (bound to every
    interface) this host's name."""
    if advertise:
        return advertise
    return socket.gethostname() if bind_host in ("0.0.0.0", "*", "::") else bind_host


async def drain(sock: zmq.asyncio.Socket) -> list[list[bytes]]:
    """Every message waiting on the socket, without yielding to the event loop between them: taking
    one per loop iteration, 64 turns that arrive together waited up to 64 busy iterations (18 ms p50
    at 64 in flight, against 0.5 ms for one turn alone)."""
    messages = []
    while True:
        try:
            messages.append(await sock.recv_multipart(flags=zmq.NOBLOCK))
        except zmq.Again:
            return messages


# -- the generation member's side ------------------------------------------------------------------

Serve = Callable[[GenerationRequest], Awaitable[GenerationResult | None]]
CancelTurn = Callable[[Abort], Awaitable[object]]


class DirectServer:
    """Serves ``serve`` on a ROUTER socket, up to ``max_in_flight`` requests at once. A service of the
    generation member: ``stop`` ends taking requests; ``run`` returns once those in flight are answered."""

    def __init__(self, serve: Serve, cancel: CancelTurn, *, bind_host: str, port: int, advertise: str | None,
                 max_in_flight: int, labels: tuple[str, str], codec: Codec = DEFAULT_CODEC):
        self.serve, self.cancel, self.codec, self.labels = serve, cancel, codec, labels
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a vanished client raises, not vanishes
        if port:
            self.socket.bind(f"tcp://{bind_host}:{port}")
        else:
            port = self.socket.bind_to_random_port(f"tcp://{bind_host}")
        self.address = f"tcp://{advertised_host(bind_host, advertise)}:{port}"
        self.slots = asyncio.Semaphore(max_in_flight)
        self.tasks: set[asyncio.Task[None]] = set()
        self._stopped = asyncio.Event()

    def stop(self) -> None:
        self._stopped.set()

    async def run(self) -> None:
        try:
            while not self._stopped.is_set():
                if not await self.socket.poll(timeout=100):
                    continue
                for frames in await drain(self.socket):
                    await self._dispatch(frames)
            if self.tasks:
                await asyncio.wait(self.tasks)
            await asyncio.sleep(0.1)  # the last replies leave the socket before it closes (linger alone lost them)
        finally:
            for task in self.tasks:
                task.cancel()
            self.socket.close(linger=1000)
            self.context.term()

    async def _dispatch(self, frames: list[bytes]) -> None:
        if len(frames) != 5:
            log.warning("direct: dropped a request of %d frames", len(frames))
            return
        identity, request_id, kind, schema, value = frames
        if kind == CANCEL:
            with contextlib.suppress(Exception):
                await self.cancel(self.codec.decode(value, [(H_SCHEMA, schema)], accept=(Abort,)).message)
            return
        await self.slots.acquire()
        task = asyncio.create_task(self._answer(identity, request_id, schema, value))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _answer(self, identity: bytes, request_id: bytes, schema: bytes, value: bytes) -> None:
        try:
            try:
                request = self.codec.decode(value, [(H_SCHEMA, schema)], accept=(GenerationRequest,)).message
                result = await self.serve(request)
            except Exception as exc:  # noqa: BLE001 - the client falls back to the bus, which dead-letters it
                DIRECT_TURNS.labels(*self.labels, "error").inc()
                await self._reply(identity, request_id, FAILED, b"", f"{type(exc).__name__}: {exc}".encode())
                return
            outcome = "aborted" if result is None else "ok"
            DIRECT_TURNS.labels(*self.labels, outcome).inc()
            if result is None:
                await self._reply(identity, request_id, GONE, b"", b"")
            else:
                await self._reply(identity, request_id, OK, self.codec.schema(result), self.codec.encode_value(result))
        finally:
            self.slots.release()

    async def _reply(self, identity: bytes, request_id: bytes, status: bytes, schema: bytes, payload: bytes) -> None:
        try:
            await self.socket.send_multipart([identity, request_id, status, schema, payload])
        except zmq.ZMQError as exc:  # the client went away: nobody waits for this
            log.info("direct: reply to a gone client dropped (%s)", exc)


# -- the env member's side -------------------------------------------------------------------------


class _Reissue(Exception):
    """The member a request was sent to disconnected."""


class _Failed(Exception):
    """The member answered with an error."""


@dataclass
class _Peer:
    """One generation member: a DEALER socket, its pending requests, whether its connection is up."""

    address: str
    socket: zmq.asyncio.Socket
    up: asyncio.Event = field(default_factory=asyncio.Event)
    pending: dict[bytes, asyncio.Future[tuple[bytes, bytes, bytes, float]]] = field(default_factory=dict)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    given_up_at: float = 0.0  # when a connect last timed out (not tried again for a while)

    def fail_pending(self) -> None:
        for future in self.pending.values():
            if not future.done():
                future.set_exception(_Reissue())


class DirectClient:
    """The env member's side: ``request`` sends a turn to a member of the pool and waits for its result."""

    CONNECT_TIMEOUT_S = 2.0
    RETRY_CONNECT_AFTER_S = 10.0

    def __init__(self, *, timeout_s: float, codec: Codec = DEFAULT_CODEC, heartbeat_ms: int = 1000):
        self.timeout_s = timeout_s
        self.codec = codec
        self.heartbeat_ms = heartbeat_ms
        self.context = zmq.asyncio.Context()
        self.peers: dict[str, _Peer] = {}
        self._ids = itertools.count()

    async def request(self, addresses: list[str], build: Callable[[int], GenerationRequest],
                      *, first_attempt: int = 0) -> tuple[Delivery | None, int]:
        """Send ``build(attempt)`` to the trajectory's member among ``addresses`` and wait for its result.
        Returns (result and when it arrived, next attempt); None when no member could answer (the caller
        then sends attempt ``next attempt`` over the bus). TimeoutError after ``timeout_s``."""
        attempt, tried = first_attempt, set()
        while True:
            request = build(attempt)
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
            await peer.socket.send_multipart([request_id, REQUEST, self.codec.schema(request), self.codec.encode_value(request)])
            status, schema, payload, arrived = await asyncio.wait_for(future, self.timeout_s)
        except asyncio.TimeoutError:
            await self._cancel(peer, request)
            raise
        except asyncio.CancelledError:
            await asyncio.shield(self._cancel(peer, request))
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

    async def _cancel(self, peer: _Peer, request: GenerationRequest) -> None:
        """Best effort: tell the member's engine to stop the request."""
        abort = request.cancellation()
        with contextlib.suppress(zmq.ZMQError):
            await peer.socket.send_multipart([b"", CANCEL, self.codec.schema(abort), self.codec.encode_value(abort)],
                                             flags=zmq.NOBLOCK)

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
                    await asyncio.wait_for(peer.up.wait(), self.CONNECT_TIMEOUT_S)
                    return peer
                except asyncio.TimeoutError:
                    peer.given_up_at = time.monotonic()
            candidates.remove(address)
        return None

    def _peer(self, address: str) -> _Peer:
        peer = self.peers.get(address)
        if peer is None:
            sock = self.context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing for a connection that is not up
            sock.setsockopt(zmq.HEARTBEAT_IVL, self.heartbeat_ms)  # a silent peer counts as disconnected
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * self.heartbeat_ms)
            monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
            sock.connect(address)
            peer = self.peers[address] = _Peer(address, sock)
            peer.tasks = [asyncio.create_task(self._read(peer)), asyncio.create_task(self._watch(peer, monitor))]
        return peer

    async def _read(self, peer: _Peer) -> None:
        while True:
            await peer.socket.poll()
            messages, arrived = await drain(peer.socket), time.perf_counter()
            for frames in messages:
                future = peer.pending.get(frames[0]) if len(frames) == 4 else None
                if future is not None and not future.done():
                    future.set_result((frames[1], frames[2], frames[3], arrived))

    async def _watch(self, peer: _Peer, monitor: zmq.asyncio.Socket) -> None:
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    peer.given_up_at = 0.0
                    peer.up.set()
                elif event == zmq.EVENT_DISCONNECTED:
                    peer.up.clear()
                    peer.fail_pending()
        finally:
            monitor.close(0)

    async def retain(self, live: set[str]) -> None:
        """Close the sockets of members no longer live (restarted members come back on new addresses:
        without this a long run with restarts would keep a socket and two tasks per address it saw)."""
        for address in [a for a, peer in self.peers.items() if a not in live and not peer.pending]:
            await self._close_peer(self.peers.pop(address))

    async def _close_peer(self, peer: _Peer) -> None:
        peer.fail_pending()
        for task in peer.tasks:
            task.cancel()
        await asyncio.gather(*peer.tasks, return_exceptions=True)
        peer.socket.disable_monitor()
        peer.socket.close(0)

    async def close(self) -> None:
        for peer in self.peers.values():
            await self._close_peer(peer)
        self.peers.clear()
        self.context.term()
