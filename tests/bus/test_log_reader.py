"""The log reader outside any group: read_to_end stops at the end seen at the start; tail goes on."""

from __future__ import annotations

import asyncio
import contextlib

from rollart.bus.reader import ReadStart, read_to_end, tail
from rollart.messages import DEFAULT_CODEC, TaskSpec
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
    await asyncio.wait_for(follower, 30)
    assert seen == [f"g{i}" for i in range(5)]
