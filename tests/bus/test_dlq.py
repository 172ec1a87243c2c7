"""Bad messages land in the topic's DLQ with provenance headers; the consumer keeps going."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from rollart.bus import DeadLetterRateExceeded, PermanentError
from rollart.bus.dlq import H_DLQ_ERROR, H_DLQ_FIELD, H_DLQ_OFFSET, H_DLQ_PARTITION, H_DLQ_STAGE, H_DLQ_TOPIC
from rollart.bus.reader import read_to_end
from rollart.messages import TaskSpec
from rollart.messages.codec import H_SCHEMA
from rollart.runtime import open_runtime
from rollart.timeouts import wait_for
from tests.conftest import ALL_BROKERS, BOTH_BROKERS, eventually, make_config



def _task(i: int) -> TaskSpec:
    return TaskSpec(group_id=f"g{i}", env="e", tag="t", group_size=1)


async def _dlq_records(runtime, logical: str):
    return [r async for r in read_to_end(runtime.config, runtime.endpoints, f"{runtime.config.job}.{logical}.dlq")]


@ALL_BROKERS  # the broker contract
async def test_garbage_and_unknown_major_go_to_dlq_and_processing_continues(runtime, loops):
    topic = f"{runtime.config.job}.tasks"
    handled = []

    async def handle(envelope, ctx) -> None:
        handled.append(envelope.message.group_id)

    await runtime.producer.send_and_wait("tasks", _task(0), key="k")
    garbage = await (await runtime.producer.send_raw(topic, b"\x93\xc1garbage", key=b"k",
                                                     headers=[(H_SCHEMA, b"TaskSpec/1.0")]))
    headers, value = runtime.producer.codec.encode(_task(1), job=runtime.config.job)
    headers = [(k, b"TaskSpec/9.0" if k == H_SCHEMA else v) for k, v in headers]
    future_major = await (await runtime.producer.send_raw(topic, value, key=b"k", headers=headers))
    no_headers = await (await runtime.producer.send_raw(topic, msgpack.packb({"a": 1}), key=b"k"))
    await runtime.producer.send_and_wait("tasks", _task(2), key="k")  # same key: same partition, after them

    await loops.start(runtime.consumer_loop("env", ["tasks"], handle))
    await eventually(lambda: handled == ["g0", "g2"], what="good messages around the bad ones handled")

    dead = await eventually(lambda: _enough(_dlq_records(runtime, "tasks"), 3), what="3 records in the DLQ")
    by_offset = {int(dict(r.headers)[H_DLQ_OFFSET]): r for r in dead}
    assert set(by_offset) == {garbage.offset, future_major.offset, no_headers.offset}
    for meta in (garbage, future_major, no_headers):
        record = by_offset[meta.offset]
        h = dict(record.headers)
        assert h[H_DLQ_TOPIC] == topic.encode()
        assert int(h[H_DLQ_PARTITION]) == meta.partition
        assert h[H_DLQ_STAGE] == b"env"
        assert record.key == b"k"
    assert by_offset[garbage.offset].value == b"\x93\xc1garbage", "the DLQ keeps the original bytes"
    assert b"major version 9" in dict(by_offset[future_major.offset].headers)[H_DLQ_ERROR]
    assert dict(by_offset[no_headers.offset].headers)[H_DLQ_FIELD] == b"header:rollart-schema"


async def _enough(coro, n):
    records = await coro
    return records if len(records) >= n else None


@ALL_BROKERS
async def test_handler_failure_is_retried_then_dead_lettered(runtime, loops):
    attempts: dict[str, int] = {}
    done = []

    async def handle(envelope, ctx) -> None:
        gid = envelope.message.group_id
        attempts[gid] = attempts.get(gid, 0) + 1
        if gid == "g1":
            raise RuntimeError("env exploded")
        if gid == "g2" and attempts[gid] < 2:
            raise ConnectionError("transient")
        if gid == "g3":
            raise PermanentError("never valid")
        done.append(gid)

    for i in range(5):
        await runtime.producer.send_and_wait("tasks", _task(i), key="same")
    await loops.start(runtime.consumer_loop("env", ["tasks"], handle))
    await eventually(lambda: done == ["g0", "g2", "g4"], what="the good and the transient messages handled")
    assert attempts["g1"] == runtime.config.bus.handler_attempts
    assert attempts["g2"] == 2 and attempts["g3"] == 1
    dead = await eventually(lambda: _enough(_dlq_records(runtime, "tasks"), 2), what="2 dead letters")
    errors = sorted(dict(r.headers)[H_DLQ_ERROR].decode() for r in dead)
    assert errors == ["handler: PermanentError: never valid", "handler: RuntimeError: env exploded"]


@BOTH_BROKERS  # reads the group's commits with an aiokafka consumer
async def test_dlq_rate_limit_stops_the_consumer_without_committing(endpoints, loops):
    config = make_config(endpoints, bus={"dlq_max_per_minute": 3})
    from rollart.topics import expand_catalog
    from rollart.topics.admin import apply_topics

    await apply_topics(config, endpoints, expand_catalog(config))
    async with open_runtime(config, serve=False) as rt:
        topic = f"{config.job}.tasks"
        for _ in range(6):
            await (await rt.producer.send_raw(topic, b"bad", key=b"k", headers=[(H_SCHEMA, b"TaskSpec/1.0")]))
        loop = rt.consumer_loop("env", ["tasks"], lambda e, c: asyncio.sleep(0))
        await loops.start(loop)
        with pytest.raises(DeadLetterRateExceeded):
            await wait_for(loops.tasks.pop(loop), 30)
        dead = await _dlq_records(rt, "tasks")
        assert len(dead) == 3, "the limit caps what reaches the DLQ"

        from aiokafka import AIOKafkaConsumer
        from aiokafka.structs import TopicPartition
        probe = AIOKafkaConsumer(bootstrap_servers=endpoints.kafka_bootstrap, group_id=f"{config.job}.env",
                                 enable_auto_commit=False)
        await probe.start()
        try:
            committed = [await probe.committed(TopicPartition(topic, p)) or 0 for p in range(8)]
        finally:
            await probe.stop()
        assert sum(committed) <= 3, "the message over the limit stays uncommitted for a fixed deploy"
