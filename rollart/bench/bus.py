"""``rollart bench bus``: what the bus itself costs, on whatever broker and Redis are configured.

* produce: GenerationResult messages (``tokens`` tokens each) queued and acknowledged, msgs/s;
* consume: the same messages through a real :class:`ConsumerLoop` (decode, dedup check, handler,
  watermark commits), msgs/s;
* round trip: driver → ``ping`` → echo stage → ``pong`` → driver, one message at a time, through two
  consumer loops with the latency-sensitive fetch wait, p50/p99 seconds;
* growth (``--fill-steps``): the round trip again as the partitions it reads from fill up.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid

from rollart.bus import MessageContext
from rollart.config import RollartConfig
from rollart.messages import Envelope, Float32Array, GenerationResult, Int32Array
from rollart.runtime import Runtime, open_runtime
from rollart.topics import PhysicalTopic
from rollart.topics.admin import apply_topics
from rollart.timeouts import wait_for


def _scratch(config: RollartConfig, logical: str, partitions: int) -> PhysicalTopic:
    return PhysicalTopic(logical=logical, name=f"{config.job}.{logical}", partitions=partitions,
                         configs={"retention.ms": "3600000", "cleanup.policy": "delete"})


def _message(i: int, tokens: int, run: str) -> GenerationResult:
    return GenerationResult(traj_id=f"{run}-{i}", turn=1, token_ids=Int32Array(range(tokens)),
                            logprobs=Float32Array([-0.5] * tokens), versions=Int32Array([1] * tokens),
                            finish_reason="stop")


async def _produce(rt: Runtime, topic: str, n: int, tokens: int, run: str) -> float:
    started = time.perf_counter()
    acks = [await rt.producer.send(topic, _message(i, tokens, run), key=f"{run}-{i}") for i in range(n)]
    await asyncio.gather(*acks)
    return n / (time.perf_counter() - started)


async def _consume(rt: Runtime, topic: str, n: int, run: str) -> float:
    done = asyncio.Event()
    seen = 0
    first: list[float] = []

    async def count(envelope: Envelope, ctx: MessageContext) -> None:
        nonlocal seen
        if not first:
            first.append(time.perf_counter())
        seen += 1
        if seen >= n:
            done.set()

    loop = rt.consumer_loop(f"bench-consume-{run}", [topic], count, max_in_flight=1024)
    task = asyncio.create_task(loop.run())
    await loop.wait_started()
    await wait_for(done.wait(), 300)
    elapsed = time.perf_counter() - first[0]
    loop.stop()
    await task
    return n / elapsed


FILL = "fill-"  # traj_id prefix of the records that only fill the topics: the echo pair skips them


class EchoPair:
    """driver → ``ping`` → echo stage → ``pong`` → driver, through two consumer loops with the
    latency-sensitive fetch wait; round trips measured one message at a time."""

    def __init__(self, rt: Runtime, ping: str, pong: str, run: str):
        self.rt, self.ping, self.pong, self.run = rt, ping, pong, run
        self.waiting: dict[str, asyncio.Future] = {}
        self.fills_seen = 0
        self.loops = [rt.consumer_loop(f"bench-echo-{run}", [ping], self._echo, fetch_max_wait_ms=5),
                      rt.consumer_loop(f"bench-driver-{run}", [pong], self._arrive, fetch_max_wait_ms=5)]

    def _is_fill(self, envelope: Envelope) -> bool:
        if envelope.message.traj_id.startswith(FILL):
            self.fills_seen += 1
            return True
        return False

    async def _echo(self, envelope: Envelope, ctx: MessageContext) -> None:
        if not self._is_fill(envelope):
            await ctx.produce(self.pong, envelope.message, key=envelope.message.traj_id)

    async def _arrive(self, envelope: Envelope, ctx: MessageContext) -> None:
        if self._is_fill(envelope):
            return
        future = self.waiting.pop(envelope.message.traj_id, None)
        if future is not None:
            future.set_result(time.perf_counter())

    async def __aenter__(self) -> "EchoPair":
        self.tasks = [asyncio.create_task(loop.run()) for loop in self.loops]
        await asyncio.gather(*(loop.wait_started() for loop in self.loops))
        await _wait_assigned(self.loops)
        return self

    async def __aexit__(self, *exc) -> None:
        for loop in self.loops:
            loop.stop()
        await asyncio.gather(*self.tasks)

    async def measure(self, n: int, tag: str) -> list[float]:
        samples = []
        for i in range(n):
            message = _message(i, 16, f"{self.run}-{tag}")
            self.waiting[message.traj_id] = future = asyncio.get_running_loop().create_future()
            sent = time.perf_counter()
            await self.rt.producer.send(self.ping, message, key=message.traj_id)
            samples.append(await wait_for(future, 30) - sent)
        return samples

    async def fill(self, n: int, tag: str) -> None:
        """``n`` records into each of the two topics the round trip fetches from; returns once both loops
        have read past them (so the round trips after measure the fuller partitions, not a backlog)."""
        expected = self.fills_seen + 2 * n
        for topic in (self.ping, self.pong):
            await _produce(self.rt, topic, n, 16, f"{FILL}{self.run}-{tag}")
        deadline = time.monotonic() + 600
        while self.fills_seen < expected and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


async def _wait_assigned(loops, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(loop.assignment for loop in loops):
        if time.monotonic() > deadline:
            raise TimeoutError("consumer loops got no partitions")
        await asyncio.sleep(0.05)


async def _growth(pair: EchoPair, fill: int, steps: int, roundtrips: int) -> list[dict]:
    """Round trips again after each ``fill`` more records are stored in the partitions they fetch from
    (as ``gen.requests`` and ``env.actions`` fill during a long run): does the broker slow as it fills?
    A log-structured broker should not; an in-memory one may."""
    rows, held = [], 0
    for step in range(steps):
        await pair.fill(fill, f"s{step}")
        held += fill
        samples = await pair.measure(roundtrips, f"g{step}")
        rows.append({"records_per_partition": held, "roundtrip_p50_s": round(statistics.median(samples), 6),
                     "roundtrip_p99_s": round(percentile(samples, 0.99), 6)})
    return rows


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def bench_bus(config: RollartConfig, *, messages: int = 20_000, tokens: int = 64,
                    roundtrips: int = 300, fill: int = 0, fill_steps: int = 0) -> dict:
    run = uuid.uuid4().hex[:8]
    topics = {"through": f"bench.{run}.through", "ping": f"bench.{run}.ping", "pong": f"bench.{run}.pong"}
    async with open_runtime(config, serve=False) as rt:
        await apply_topics(config, rt.endpoints, [_scratch(config, topics["through"], 4),
                                                  _scratch(config, topics["ping"], 1),
                                                  _scratch(config, topics["pong"], 1)])
        produce_rate = await _produce(rt, topics["through"], messages, tokens, run)
        consume_rate = await _consume(rt, topics["through"], messages, run)
        async with EchoPair(rt, topics["ping"], topics["pong"], run) as pair:
            samples = await pair.measure(roundtrips, "rt")
            growth = await _growth(pair, fill, fill_steps, roundtrips)
    return {
        "growth": growth,
        "produce_msgs_per_s": round(produce_rate, 1),
        "consume_msgs_per_s": round(consume_rate, 1),
        "roundtrip_p50_s": round(statistics.median(samples), 6),
        "roundtrip_p99_s": round(percentile(samples, 0.99), 6),
        "messages": messages,
        "tokens_per_message": tokens,
        "roundtrips": roundtrips,
    }
