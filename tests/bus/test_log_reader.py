"""The log reader outside any group: read_to_end stops at the end seen at the start; tail goes on;
where partitions end and where a group committed, read without joining it (consumer-group lag)."""

from __future__ import annotations

import asyncio
import contextlib

from rollart.bus.backend import OffsetAndMetadata, TopicPartition
from rollart.bus.kafka import group_consumer
from rollart.bus.reader import ReadStart, committed_offsets, end_offsets, read_to_end, tail
from rollart.lag import consumer_lag
from rollart.messages import DEFAULT_CODEC, TaskSpec
from rollart.timeouts import wait_for
from tests.conftest import ALL_BROKERS

pytestmark = ALL_BROKERS  # the broker contract


def _task(i: int) -> TaskSpec:
    return TaskSpec(group_id=f"g{i}", env="e", tag="t", group_size=1)


def _ids(records) -> list[str]:
    return [DEFAULT_CODEC.decode(r.value, r.headers).message.group_id for r in records]


async def test_read_to_end_reads_what_is_there_from_the_start_asked_for(runtime):
    config, endpoints = runtime.config, runtime.endpoints
    topic = runtime.producer.names.physical("tasks")
    metas = [await runtime.producer.send_and_wait("tasks", _task(i), key="one") for i in range(5)]
    assert _ids([r async for r in read_to_end(config, endpoints, topic)]) == [f"g{i}" for i in range(5)]
    later = ReadStart(offset=metas[3].offset, partition=metas[0].partition)
    assert _ids([r async for r in read_to_end(config, endpoints, topic, start=later)]) == ["g3", "g4"]
    assert [r async for r in read_to_end(config, endpoints, runtime.producer.names.physical("no.such"))] == []


async def test_tail_yields_the_log_then_what_arrives(runtime):
    topic = runtime.producer.names.physical("tasks")
    for i in range(3):
        await runtime.producer.send_and_wait("tasks", _task(i), key="one")
    seen: list[str] = []

    async def follow() -> None:
        records = tail(runtime.config, runtime.endpoints, topic, client_id="tail-test")
        async with contextlib.aclosing(records):  # closes the reader's consumer when done
            async for record in records:
                seen.extend(_ids([record]))
                if len(seen) == 5:
                    return

    follower = asyncio.create_task(follow())
    for _ in range(200):
        if len(seen) >= 3:
            break
        await asyncio.sleep(0.05)
    assert seen == ["g0", "g1", "g2"]
    for i in (3, 4):
        await runtime.producer.send_and_wait("tasks", _task(i), key="one")
    await wait_for(follower, 30)
    assert seen == [f"g{i}" for i in range(5)]


class _Quiet:
    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None: ...

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None: ...


async def test_end_and_committed_offsets_are_read_without_joining_the_group(runtime):
    config, endpoints, names = runtime.config, runtime.endpoints, runtime.producer.names
    for i in range(5):
        await runtime.producer.send_and_wait("tasks", _task(i), partition=0)
    await runtime.producer.send_and_wait("tasks", _task(5), partition=1)
    tp0, tp1 = TopicPartition(names.physical("tasks"), 0), TopicPartition(names.physical("tasks"), 1)
    group = f"{config.job}.env"
    member = group_consumer(config, endpoints, group, client_id="offsets-test", fetch_max_wait_ms=10)
    member.subscribe([tp0.topic], _Quiet())
    await member.start()
    try:
        for _ in range(300):
            if tp0 in member.assignment():
                break
            await member.getmany(timeout_ms=100)
        await member.commit({tp0: OffsetAndMetadata(3, "")})
    finally:
        await member.stop()

    missing = TopicPartition(names.physical("no.such"), 0)
    assert await end_offsets(config, endpoints, [tp0, tp1, missing], client_id="offsets-test") == {tp0: 5, tp1: 1}
    assert await committed_offsets(config, endpoints, group, [tp0, tp1], client_id="offsets-test") == {
        tp0: 3, tp1: None}
    lag = {(r.group, r.topic, r.partition): (r.committed, r.end, r.lag) for r in await consumer_lag(config, endpoints)}
    assert lag[("env", "tasks", 0)] == (3, 5, 2) and lag[("env", "tasks", 1)] == (None, 1, 1)
