"""Read a topic from a start point to its current end, outside any consumer group.

Used to rebuild caches from the log (the policy version from ``policy.versions``), by ``doctor``
and by replay. It never commits and never joins a group, so it cannot disturb the stages.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import ConsumerRecord, TopicPartition

from rollart.config import RollartConfig
from rollart.endpoints import Endpoints, kafka_client_kwargs


async def read_to_end(config: RollartConfig, endpoints: Endpoints, physical_topic: str, *,
                      start_ms: int | None = None, timeout_s: float = 30.0,
                      fetch_max_wait_ms: int = 10) -> AsyncIterator[ConsumerRecord]:
    """Yield every record of ``physical_topic`` (from ``start_ms`` if given) up to the end seen at start."""
    consumer = AIOKafkaConsumer(
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=fetch_max_wait_ms,
        client_id=f"{config.kafka.client_id}-reader",
        **kafka_client_kwargs(config.kafka, endpoints.kafka_bootstrap),
    )
    await asyncio.wait_for(consumer.start(), timeout_s)
    try:
        await consumer.topics()  # fetch metadata for every topic, so partitions_for_topic knows this one
        partitions = consumer.partitions_for_topic(physical_topic) or set()
        tps = [TopicPartition(physical_topic, p) for p in sorted(partitions)]
        if not tps:
            return
        consumer.assign(tps)
        await _seek_start(consumer, tps, start_ms)
        # The end of each partition is the high watermark of its first fetch response. Tansu's
        # ListOffsets is not reliable here (it undercounts when a batch holds several records, and
        # answered "earliest" wrongly at times), so neither end_offsets nor seek_to_beginning is used.
        ends: dict[TopicPartition, int] = {}
        remaining = set(tps)
        while remaining:
            batch = await asyncio.wait_for(consumer.getmany(*remaining, timeout_ms=200), timeout_s)
            for tp in list(remaining):
                if tp not in ends and consumer.highwater(tp) is not None:
                    ends[tp] = consumer.highwater(tp)
                for record in batch.get(tp, ()):
                    if record.offset < ends.get(tp, record.offset + 1):
                        yield record
                if tp in ends and await consumer.position(tp) >= ends[tp]:
                    remaining.discard(tp)
    finally:
        await consumer.stop()


async def _seek_start(consumer: AIOKafkaConsumer, tps: list[TopicPartition], start_ms: int | None) -> None:
    found = await consumer.offsets_for_times({tp: start_ms for tp in tps}) if start_ms is not None else {}
    for tp in tps:
        hit = found.get(tp)
        if start_ms is None:
            consumer.seek(tp, 0)  # out of range after retention: auto_offset_reset takes the earliest
        elif hit is not None:
            consumer.seek(tp, hit.offset)
        else:
            await consumer.seek_to_end(tp)  # nothing at or after start_ms
