"""Bounded in-flight work pauses the partitions; per-key order holds under concurrency."""

from __future__ import annotations

import asyncio

from rollart.messages import TaskSpec
from rollart.metrics import PAUSED
from tests.conftest import ALL_BROKERS, eventually

pytestmark = ALL_BROKERS  # the broker contract


async def _send(runtime, n: int, key_of) -> None:
    acks = [await runtime.producer.send("tasks", TaskSpec(group_id=f"g{i}", env="e", tag="t", group_size=1),
                                        key=key_of(i)) for i in range(n)]
    await asyncio.gather(*acks)


async def test_in_flight_is_bounded_and_partitions_pause(runtime, loops):
    release = asyncio.Event()
    running = 0
    peak = 0
    done = 0

    async def slow(envelope, ctx) -> None:
        nonlocal running, peak, done
        running += 1
        peak = max(peak, running)
        await release.wait()
        running -= 1
        done += 1

    await _send(runtime, 40, key_of=lambda i: f"k{i}")
    loop = await loops.start(runtime.consumer_loop("env", ["tasks"], slow, max_in_flight=4))
    await eventually(lambda: running == 4, what="4 handlers running")
    await eventually(lambda: loop.consumer.paused(), what="partitions paused")
    assert PAUSED.labels(runtime.config.job, "env")._value.get() == 1
    await asyncio.sleep(0.5)  # polling goes on while paused; nothing more may start
    assert running == 4 and peak == 4
    release.set()
    await eventually(lambda: done == 40, what="all 40 handled after release")
    assert peak == 4
    await eventually(lambda: not loop.consumer.paused(), what="partitions resumed")


async def test_same_key_in_order_different_keys_concurrently(runtime, loops):
    order: dict[str, list[int]] = {"a": [], "b": []}
    concurrent = 0
    overlap_seen = False

    async def handle(envelope, ctx) -> None:
        nonlocal concurrent, overlap_seen
        key = ctx.record.key.decode()
        concurrent += 1
        overlap_seen = overlap_seen or concurrent > 1
        await asyncio.sleep(0.01 * (int(envelope.message.group_id[1:]) % 3))  # finish out of order if allowed
        order[key].append(int(envelope.message.group_id[1:]))
        concurrent -= 1

    # "a" and "b" may hash to one partition or two; either way each key's order must hold.
    await _send(runtime, 30, key_of=lambda i: "a" if i % 2 else "b")
    await loops.start(runtime.consumer_loop("env", ["tasks"], handle))
    await eventually(lambda: len(order["a"]) + len(order["b"]) == 30, what="30 handled")
    assert order["a"] == sorted(order["a"]) and order["b"] == sorted(order["b"])
    assert overlap_seen, "different keys should be handled concurrently"
