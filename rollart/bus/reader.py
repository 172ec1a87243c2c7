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
        fetch_max_wait_ms=fetch_max_wait_ms,
        client_id=f"{config.kafka.client_id}-reader",
        **kafka_client_kwargs(config.kafka, endpoints.kafka_bootstrap),
    )
    await asyncio.wait_for(consumer.start(), timeout_s)
    try:
        partitions = consumer.partitions_for_topic(physical_topic)
        if partitions is None:
            await consumer._client.force_metadata_update()  # topic created after our first metadata fetch
            partitions = consumer.partitions_for_topic(physical_topic) or set()
        tps = [TopicPartition(physical_topic, p) for p in sorted(partitions)]
        if not tps:
            return
        consumer.assign(tps)
        ends = await consumer.end_offsets(tps)
        await _seek_start(consumer, tps, start_ms)
        remaining = {tp for tp in tps if await consumer.position(tp) < ends[tp]}
        while remaining:
            batch = await asyncio.wait_for(consumer.getmany(*remaining, timeout_ms=200), timeout_s)
            for tp, records in batch.items():
                for record in records:
                    if record.offset < ends[tp]:
                        yield record
                if await consumer.position(tp) >= ends[tp]:
                    remaining.discard(tp)
    finally:
        await consumer.stop()


async def _seek_start(consumer: AIOKafkaConsumer, tps: list[TopicPartition], start_ms: int | None) -> None:
    if start_ms is None:
        await consumer.seek_to_beginning(*tps)
        return
    found = await consumer.offsets_for_times({tp: start_ms for tp in tps})
    ends = await consumer.end_offsets(tps)
    for tp in tps:
        hit = found.get(tp)
        consumer.seek(tp, hit.offset if hit is not None else ends[tp])
