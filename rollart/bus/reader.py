"""Read a topic outside any consumer group: to its current end (:func:`read_to_end`), or on and on
(:func:`tail`); look up where partitions end and where a group committed, without joining it
(:func:`end_offsets`, :func:`committed_offsets`: consumer-group lag).

Used to rebuild caches from the log (the policy version from ``policy.versions``), by replay, and by
every member that must see every announcement (weight followers). It never commits and never joins a
group, so it cannot disturb the stages. On the in-memory broker (``rollart.bus.memory``) it reads the
broker's log directly.

Where to start and where the end is come from the broker's ListOffsets (earliest, latest, by
timestamp), so a reader of a week-long topic reads only the records it asks for. Tansu answers
ListOffsets wrongly (see the README's broker notes): on it the reader starts at offset 0 and takes
each partition's end from its first fetch response's high watermark.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import AsyncIterator

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import ConsumerRecord, TopicPartition

from rollart.bus.memory import InMemoryBroker
from rollart.bus.transaction import isolation_level
from rollart.config import RollartConfig
from rollart.endpoints import Endpoints, kafka_client_kwargs
from rollart.timeouts import wait_for


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
    consumer = _reader(config, endpoints, f"{config.kafka.client_id}-reader", fetch_max_wait_ms)
    await wait_for(consumer.start(), timeout_s)
    try:
        tps = _chosen(await topic_partitions(consumer, physical_topic), start)
        if not tps:
            return
        consumer.assign(tps)
        read = _read_tansu if endpoints.broker == "tansu" else _read_kafka
        async for record in read(consumer, tps, start, timeout_s):
            yield record
    finally:
        await consumer.stop()


async def tail(config: RollartConfig, endpoints: Endpoints, physical_topic: str, *, client_id: str,
               start: ReadStart | None = None, timeout_s: float = 30.0,
               poll_ms: int = 200) -> AsyncIterator[ConsumerRecord]:
    """Yield every record of ``physical_topic`` from ``start`` (the earliest by default), then each new
    one as it arrives; never ends by itself: cancel the task, or leave the loop inside
    ``contextlib.aclosing`` so that the reader's consumer closes at once. Partitions are those the topic
    has when tailing begins (none, for a topic that does not exist yet: it then yields nothing)."""
    start = start or ReadStart()
    if endpoints.broker == "memory":
        async for record in _tail_memory(endpoints, physical_topic, start, poll_ms):
            yield record
        return
    consumer = _reader(config, endpoints, client_id, config.bus.fetch_max_wait_ms)
    await wait_for(consumer.start(), timeout_s)
    try:
        tps = _chosen(await topic_partitions(consumer, physical_topic), start)
        consumer.assign(tps)
        if endpoints.broker == "tansu":
            firsts = {tp: start.offset or 0 for tp in tps}  # see _read_tansu: ListOffsets is not trusted
        else:
            firsts, _ = await _kafka_start(consumer, tps, start, timeout_s)
        for tp, offset in firsts.items():
            consumer.seek(tp, offset)
        while True:
            batch = await consumer.getmany(timeout_ms=poll_ms)
            for record in (r for records in batch.values() for r in records):
                if start.since_ms is None or record.timestamp >= start.since_ms:
                    yield record
    finally:
        await consumer.stop()


def _reader(config: RollartConfig, endpoints: Endpoints, client_id: str, fetch_max_wait_ms: int) -> AIOKafkaConsumer:
    return AIOKafkaConsumer(
        enable_auto_commit=False,
        auto_offset_reset="earliest",  # an offset before the log start (retention) reads from its start
        fetch_max_wait_ms=fetch_max_wait_ms,
        client_id=client_id,
        isolation_level=isolation_level(config),
        **kafka_client_kwargs(config.kafka, endpoints.kafka_bootstrap),
    )


def _chosen(tps: list[TopicPartition], start: ReadStart) -> list[TopicPartition]:
    return [tp for tp in tps if start.partition is None or tp.partition == start.partition]


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


async def _kafka_start(consumer: AIOKafkaConsumer, tps: list[TopicPartition], start: ReadStart,
                       timeout_s: float) -> tuple[dict[TopicPartition, int], dict[TopicPartition, int]]:
    """Where ``start`` begins each partition, and each partition's end, from the broker's ListOffsets."""
    ends = await wait_for(consumer.end_offsets(tps), timeout_s)
    firsts = await wait_for(consumer.beginning_offsets(tps), timeout_s)
    found = {}
    if start.since_ms is not None:
        found = await wait_for(consumer.offsets_for_times({tp: start.since_ms for tp in tps}), timeout_s)
    offsets = {}
    for tp in tps:
        offset = firsts[tp]
        if start.since_ms is not None:
            hit = found.get(tp)
            offset = hit.offset if hit is not None else ends[tp]  # nothing at or after since_ms
        offsets[tp] = _clamped(offset, ends[tp], start)
    return offsets, ends


def _clamped(first: int, end: int, start: ReadStart) -> int:
    """``first`` moved up to ``start.offset`` and to the last ``start.tail`` records before ``end``."""
    if start.offset is not None:
        first = max(first, start.offset)
    if start.tail is not None:
        first = max(first, end - start.tail)
    return first


async def _read_kafka(consumer: AIOKafkaConsumer, tps: list[TopicPartition], start: ReadStart,
                      timeout_s: float) -> AsyncIterator[ConsumerRecord]:
    firsts, ends = await _kafka_start(consumer, tps, start, timeout_s)
    remaining = set()
    for tp, offset in firsts.items():
        if offset < ends[tp]:
            consumer.seek(tp, offset)
            remaining.add(tp)
    stall = _Stall(timeout_s, ends)
    while remaining:
        batch = await wait_for(consumer.getmany(*remaining, timeout_ms=200), timeout_s)
        positions = {}
        for tp in list(remaining):
            for record in batch.get(tp, ()):
                if record.offset < ends[tp]:
                    yield record
            # Compaction and transaction markers leave gaps: the position, not the last record, says done.
            positions[tp] = await consumer.position(tp)
            if positions[tp] >= ends[tp]:
                remaining.discard(tp)
        stall.check(positions)


class _Stall:
    """Fails a read whose positions have not moved for ``timeout_s``: a partition it cannot read on to
    the end it saw (a leader gone, an end past what the reader may see) ends the read with where each
    stood, instead of polling for ever."""

    def __init__(self, timeout_s: float, ends: dict[TopicPartition, int]):
        self.timeout_s = timeout_s
        self.ends = ends  # filled in later by the Tansu read
        self._positions: dict[TopicPartition, int] = {}
        self._moved = time.monotonic()

    def check(self, positions: dict[TopicPartition, int]) -> None:
        if positions != self._positions:
            self._positions, self._moved = positions, time.monotonic()
        elif positions and time.monotonic() - self._moved > self.timeout_s:
            stuck = ", ".join(f"{tp.topic}[{tp.partition}] at {at} of {self.ends.get(tp, '?')}"
                              for tp, at in sorted(positions.items()))
            raise TimeoutError(f"reading to the end made no progress for {self.timeout_s:g} s: {stuck}")


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
    stall = _Stall(timeout_s, ends)
    while remaining:
        batch = await wait_for(consumer.getmany(*remaining, timeout_ms=200), timeout_s)
        positions = {}
        for tp in list(remaining):
            if tp not in ends and consumer.highwater(tp) is not None:
                ends[tp] = consumer.highwater(tp)
            for record in batch.get(tp, ()):
                if record.offset < ends.get(tp, record.offset + 1) and \
                        (start.since_ms is None or record.timestamp >= start.since_ms):
                    yield record
            positions[tp] = await consumer.position(tp)
            if tp in ends and positions[tp] >= ends[tp]:
                remaining.discard(tp)
        stall.check(positions)



def _memory_start(broker: "InMemoryBroker", tp: TopicPartition, start: ReadStart) -> int:
    """The offset Kafka's ListOffsets would give for ``start`` (the log starts at 0: no retention)."""
    first = 0
    if start.since_ms is not None:  # the first record at or after since_ms (offsets_for_times)
        first = next((r.offset for r in broker.records(tp, 0) if r.timestamp >= start.since_ms), broker.end(tp))
    return _clamped(first, broker.end(tp), start)


def _read_memory(endpoints: Endpoints, physical_topic: str, start: ReadStart) -> list[ConsumerRecord]:
    broker = InMemoryBroker.at(endpoints.kafka_bootstrap)
    out: list[ConsumerRecord] = []
    for tp in _chosen(broker.partitions(physical_topic), start):
        first, end = _memory_start(broker, tp, start), broker.end(tp)
        out.extend(broker.records(tp, first, max(0, end - first)))
    return out


async def _tail_memory(endpoints: Endpoints, physical_topic: str, start: ReadStart,
                       poll_ms: int) -> AsyncIterator[ConsumerRecord]:
    broker = InMemoryBroker.at(endpoints.kafka_bootstrap)
    positions = {tp: _memory_start(broker, tp, start) for tp in _chosen(broker.partitions(physical_topic), start)}
    while True:
        found = False
        for tp, position in positions.items():
            for record in broker.records(tp, position):
                positions[tp] = record.offset + 1
                found = True
                yield record
        if not found:
            await broker.wait_for_change(poll_ms / 1000)


async def end_offsets(config: RollartConfig, endpoints: Endpoints, tps: list[TopicPartition], *,
                      client_id: str) -> dict[TopicPartition, int]:
    """The end (the next record's offset) of each of ``tps`` that exists (a partition of a topic that
    does not exist has no entry): the broker's ListOffsets (latest), as Kafka's own
    ``kafka-consumer-groups --describe`` takes it; on Tansu, whose ListOffsets undercounts, the high
    watermark of a fetch; on the in-memory broker, its log."""
    if endpoints.broker == "memory":
        broker = InMemoryBroker.at(endpoints.kafka_bootstrap)
        return {tp: broker.end(tp) for tp in tps if tp in broker.partitions(tp.topic)}
    consumer = AIOKafkaConsumer(enable_auto_commit=False, fetch_max_wait_ms=10, max_partition_fetch_bytes=1024,
                                client_id=client_id, **kafka_client_kwargs(config.kafka, endpoints.kafka_bootstrap))
    await consumer.start()
    try:
        found = await partitions_of(consumer, sorted({tp.topic for tp in tps}))
        existing = {tp for partitions in found.values() for tp in partitions}
        tps = [tp for tp in tps if tp in existing]
        if endpoints.broker != "tansu":
            return await consumer.end_offsets(tps) if tps else {}
        return await _tansu_ends(consumer, tps)
    finally:
        await consumer.stop()


async def _tansu_ends(consumer: AIOKafkaConsumer, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
    consumer.assign(tps)
    for tp in tps:
        consumer.seek(tp, 0)
    ends: dict[TopicPartition, int] = {}
    for _ in range(50):
        await consumer.getmany(timeout_ms=100)
        for tp in tps:
            if tp not in ends and consumer.highwater(tp) is not None:
                ends[tp] = consumer.highwater(tp)
        if len(ends) == len(tps):
            break
    return {tp: ends.get(tp, 0) for tp in tps}


async def committed_offsets(config: RollartConfig, endpoints: Endpoints, group_id: str, tps: list[TopicPartition], *,
                            client_id: str) -> dict[TopicPartition, int | None]:
    """``group_id``'s committed offset of each of ``tps`` (None: it never committed there), from an
    OffsetFetch: the group is not joined, so nothing rebalances."""
    if endpoints.broker == "memory":
        found = InMemoryBroker.at(endpoints.kafka_bootstrap).committed(group_id, tps)
        return {tp: found[tp].offset if tp in found else None for tp in tps}
    consumer = AIOKafkaConsumer(group_id=group_id, enable_auto_commit=False, client_id=client_id,
                                **kafka_client_kwargs(config.kafka, endpoints.kafka_bootstrap))
    await consumer.start()
    try:
        return {tp: await consumer.committed(tp) for tp in tps}
    finally:
        await consumer.stop()
