"""Request/reply over the bus: ask a generation pool, get the answer on a partition this member owns.

A member consumes a reply topic (``env.actions`` for the env stage, ``rewards.judge`` for LLM-judge
rewards) in its own consumer group. Each request names one of the reply partitions currently
assigned to the member (``reply_partition``); the generation stage produces the result exactly there.
When a partition is revoked, requests waiting on it are re-issued (``attempt + 1``) with a partition
the member still owns; their late results elsewhere are counted as orphans and dropped.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

from aiokafka.structs import TopicPartition
from prometheus_client import Counter

from rollart.bus import MessageContext
from rollart.messages import Envelope, GenerationRequest, GenerationResult
from rollart.runtime import Runtime
from rollart.names import ENV_ACTIONS, gen_requests
from rollart.timeouts import wait_for

ORPHANS = Counter("rollart_bus_orphan_replies_total",
                  "Replies for no request of this member (late, after an abort or a re-issue)", ("job", "topic"))


class Delivery(NamedTuple):
    """A turn's result and when it reached this member (``time.perf_counter()``): the trajectory's
    coroutine resumes later, once the member's event loop gets to it. The gap is the member's own
    load (other trajectories' turns), not the transport's: the env stage measures the two apart."""

    result: GenerationResult
    at: float


class NoReplyPartition(Exception):
    """The member owned no reply partition for the whole timeout."""


class _Reissue(Exception):
    """The reply partition of a pending request was revoked."""


@dataclass
class _Pending:
    future: asyncio.Future
    partition: int


class ReplyChannel:
    def __init__(self, runtime: Runtime, reply_topic: str, *, timeout_s: float):
        self.rt = runtime
        self.reply_topic = reply_topic
        self.timeout_s = timeout_s
        self.physical = runtime.producer.names.physical(reply_topic)
        self.owned: list[int] = []
        self._owned_changed = asyncio.Event()
        self._next = 0
        self.pending: dict[tuple[str, str, int, int], _Pending] = {}

    def consumer_loop(self, group: str, **kwargs):
        # No Redis de-duplication: a reply is matched to its pending request by key, so a copy finds
        # none and is counted as an orphan; the check would cost two Redis round trips on every turn.
        return self.rt.consumer_loop(group, [self.reply_topic], self.handle_reply, ordering="none", dedup=False,
                                     fetch_max_wait_ms=self._fetch_max_wait_ms(),
                                     on_assign=self.on_assign, on_revoke=self.on_revoke, **kwargs)

    def _fetch_max_wait_ms(self) -> int:
        generation = self.rt.config.generation
        # env.actions carries only the direct path's fallback under transport: direct; rewards.judge every turn
        return generation.turn_fetch_max_wait_ms() if self.reply_topic == ENV_ACTIONS else generation.fetch_max_wait_ms

    async def on_assign(self, tps: set[TopicPartition]) -> None:
        self.owned = sorted(set(self.owned) | {tp.partition for tp in tps if tp.topic == self.physical})
        self._owned_changed.set()

    async def on_revoke(self, tps: set[TopicPartition]) -> None:
        revoked = {tp.partition for tp in tps if tp.topic == self.physical}
        self.owned = [p for p in self.owned if p not in revoked]
        for pending in list(self.pending.values()):
            if pending.partition in revoked and not pending.future.done():
                pending.future.set_exception(_Reissue())

    async def handle_reply(self, envelope: Envelope, ctx: MessageContext) -> None:
        result: GenerationResult = envelope.message
        pending = self.pending.pop((result.traj_id, result.episode, result.turn, result.attempt), None)
        if pending is None or pending.future.done():
            ORPHANS.labels(self.rt.config.job, self.reply_topic).inc()
            return
        pending.future.set_result(Delivery(result, time.perf_counter()))

    async def _partition(self) -> int:
        deadline = time.monotonic() + self.timeout_s
        while not self.owned:
            self._owned_changed.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise NoReplyPartition(f"no {self.reply_topic} partition assigned for {self.timeout_s:.0f}s")
            try:
                await wait_for(self._owned_changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass
        self._next = (self._next + 1) % len(self.owned)
        return self.owned[self._next]

    async def request(self, build: Callable[[int, int], GenerationRequest], *,
                      first_attempt: int = 0) -> Delivery:
        """Send ``build(reply_partition, attempt)`` and wait for its result (TimeoutError after timeout_s)."""
        attempt = first_attempt
        while True:
            request = build(await self._partition(), attempt)
            key = (request.traj_id, request.episode, request.turn, request.attempt)
            future = asyncio.get_running_loop().create_future()
            self.pending[key] = _Pending(future, request.reply_partition)
            try:
                await self.rt.producer.send_and_wait(gen_requests(request.pool), request, key=request.traj_id)
                return await wait_for(future, self.timeout_s)
            except _Reissue:
                attempt += 1
            except asyncio.TimeoutError:
                await self.cancel(request)
                raise
            except asyncio.CancelledError:
                await asyncio.shield(self.cancel(request))
                raise
            finally:
                self.pending.pop(key, None)

    async def cancel(self, request: GenerationRequest) -> None:
        """Best effort: tell the engine to stop; if this fails, the late result is an orphan."""
        try:
            await self.rt.producer.send(gen_requests(request.pool), request.cancellation(), key=request.traj_id)
        except Exception:  # noqa: BLE001
            pass
