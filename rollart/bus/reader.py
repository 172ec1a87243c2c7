"""Read a topic from a start point to its current end, outside any consumer group.

Used to rebuild caches from the log (the policy version from ``policy.versions``), by ``doctor``
and by replay. It never commits and never joins a group, so it cannot disturb the stages.

Where to start and where the end is come from the broker's ListOffsets (earliest, latest, by
timestamp), so a reader of a week-long topic reads only the records it asks for. Tansu answers
ListOffsets wrongly (see the README's broker notes): on it the reader starts at offset 0 and takes
each partition's end from its first fetch response's high watermark.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import ConsumerRecord, TopicPartition

from rollart.bus.transaction import isolation_level
from rollart.config import RollartConfig
from rollart.endpoints import Endpoints, kafka_client_kwargs


@dataclass(frozen=True)
class ReadStart:
    """Where each partition is read from: the earliest record by default; else the first record at or
    after ``since_ms``, or ``offset``; ``tail``: only the last ``tail`` records of each partition."""

    since_ms: int | None = None
    offset: int | None = None
    tail: int | None = None
    partition: int | None = None  # read only this partition


async def read_to_end(config: RollartConfig, endpoints: Endpoints, physical_topic: str, *,
                      start_ms: int | None = None, start: ReadStart | None = None, timeout_s: float = 30.0,
                      fetch_max_wait_ms: int = 10) -> AsyncIterator[ConsumerRecord]:
    """Yield every record of ``physical_topic`` from ``start`` up to the end seen when reading began."""
    start = start or ReadStart(since_ms=start_ms)
    if endpoints.broker == "memory":
        for record in _read_memory(endpoints, physical_topic, start):
            yield record
        return
    consumer = AIOKafkaConsumer(
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=fetch_max_wait_ms,
        client_id=f"{config.kafka.client_id}-reader",
        isolation_level=isolation_level(config),
        **kafka_client_kwargs(config.kafka, endpoints.kafka_bootstrap),
    )
    await asyncio.wait_for(consumer.start(), timeout_s)
    try:
        tps = [tp for tp in await topic_partitions(consumer, physical_topic)
               if start.partition is None or tp.partition == start.partition]
        if not tps:
            return
        consumer.assign(tps)
        read = _read_tansu if endpoints.broker == "tansu" else _read_kafka
        async for record in read(consumer, tps, start, timeout_s):
            yield record
    finally:
        await consumer.stop()


async def topic_partitions(consumer: AIOKafkaConsumer, topic: str) -> list[TopicPartition]:
    """The partitions of ``topic`` from a fresh metadata request ([] when it does not exist).

    ``consumer.topics()`` fetches every topic's metadata but keeps only the names; the consumer's own
    cluster view holds only topics it subscribed to (Tansu answered a request for no topics with all
    of them, Apache Kafka answers it with none), so the full answer is asked for and read here."""
    return (await partitions_of(consumer, [topic]))[topic]


async def partitions_of(consumer: AIOKafkaConsumer, topics: list[str]) -> dict[str, list[TopicPartition]]:
    """The partitions of each of ``topics``, from one metadata request (see topic_partitions)."""
    cluster = await consumer._client.fetch_all_metadata()  # aiokafka has no public call for this
    return {t: [TopicPartition(t, p) for p in sorted(cluster.partitions_for_topic(t) or ())] for t in topics}


async def _read_kafka(consumer: AIOKafkaConsumer, tps: list[TopicPartition], start: ReadStart,
                      timeout_s: float) -> AsyncIterator[ConsumerRecord]:
    ends = await asyncio.wait_for(consumer.end_offsets(tps), timeout_s)
    firsts = await asyncio.wait_for(consumer.beginning_offsets(tps), timeout_s)
    found = {}
    if start.since_ms is not None:
        found = await asyncio.wait_for(consumer.offsets_for_times({tp: start.since_ms for tp in tps}), timeout_s)
    remaining = set()
    for tp in tps:
        offset = firsts[tp]
        if start.since_ms is not None:
            hit = found.get(tp)
            offset = hit.offset if hit is not None else ends[tp]  # nothing at or after since_ms
        if start.offset is not None:
            offset = max(offset, start.offset)
        if start.tail is not None:
            offset = max(offset, ends[tp] - start.tail)
        if offset < ends[tp]:
            consumer.seek(tp, offset)
            remaining.add(tp)
    while remaining:
        batch = await asyncio.wait_for(consumer.getmany(*remaining, timeout_ms=200), timeout_s)
        for tp in list(remaining):
            for record in batch.get(tp, ()):
                if record.offset < ends[tp]:
                    yield record
            # Compaction and transaction markers leave gaps: the position, not the last record, says done.
            if await consumer.position(tp) >= ends[tp]:
                remaining.discard(tp)


async def _read_tansu(consumer: AIOKafkaConsumer, tps: list[TopicPartition], start: ReadStart,
                      timeout_s: float) -> AsyncIterator[ConsumerRecord]:
    # Tansu's ListOffsets undercounts when a batch holds several records and answers "earliest" and
    # times wrongly, so neither end_offsets, seek_to_beginning nor offsets_for_times is used: every
    # partition is read from its start (or ``offset``) and ``since_ms`` filters by record timestamp;
    # ``tail`` reads all. Tansu holds its log in memory, so these logs are small.
    for tp in tps:
        consumer.seek(tp, start.offset or 0)  # out of range after retention: auto_offset_reset
    ends: dict[TopicPartition, int] = {}
    remaining = set(tps)
    while remaining:
        batch = await asyncio.wait_for(consumer.getmany(*remaining, timeout_ms=200), timeout_s)
        for tp in list(remaining):
            if tp not in ends and consumer.highwater(tp) is not None:
                ends[tp] = consumer.highwater(tp)
            for record in batch.get(tp, ()):
                if record.offset < ends.get(tp, record.offset + 1) and \
                        (start.since_ms is None or record.timestamp >= start.since_ms):
                    yield record
            if tp in ends and await consumer.position(tp) >= ends[tp]:
                remaining.discard(tp)


def _read_memory(endpoints: Endpoints, physical_topic: str, start: ReadStart) -> list[ConsumerRecord]:
    """The in-memory broker's log (rollart.bus.memory), with the ListOffsets answers Kafka would give."""
    from rollart.bus.memory import InMemoryBroker

    broker = InMemoryBroker.at(endpoints.kafka_bootstrap)
    out: list[ConsumerRecord] = []
    for tp in broker.partitions(physical_topic):
        if start.partition is not None and tp.partition != start.partition:
            continue
        end = broker.end(tp)
        records = broker.records(tp, 0, end)
        offset = 0
        if start.since_ms is not None:  # the first record at or after since_ms (offsets_for_times)
            offset = next((r.offset for r in records if r.timestamp >= start.since_ms), end)
        if start.offset is not None:
            offset = max(offset, start.offset)
        if start.tail is not None:
            offset = max(offset, end - start.tail)
        out.extend(records[offset:end])
    return out
