"""Consumer-group lag per topic and partition: end offset minus committed offset.

The groups of a topic are the ``consumers`` of its catalog entry (``gen-{pool}`` expanded per pool),
named ``<job>.<group>`` on the broker. Committed offsets come from an OffsetFetch of each group
(without joining it, so nothing rebalances); end offsets from ListOffsets (latest), as Kafka's own
``kafka-consumer-groups --describe`` computes them. On Tansu, whose ListOffsets undercounts, from
the high watermark of a fetch instead (see the README's broker notes).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition
from prometheus_client import Gauge

from rollart.bus.reader import partitions_of
from rollart.config import RollartConfig
from rollart.endpoints import Endpoints, kafka_client_kwargs
from rollart.topics import expand_catalog

GROUP_LAG = Gauge("rollart_consumer_group_lag_messages", "End offset minus committed offset, per group and partition",
                  ("job", "group", "topic", "partition"))


@dataclass(frozen=True)
class LagRow:
    group: str
    topic: str  # logical
    partition: int
    committed: int | None  # None: the group never committed on this partition
    end: int

    @property
    def lag(self) -> int:
        return max(0, self.end - (self.committed or 0))


def group_topics(config: RollartConfig) -> list[tuple[str, str, str, int]]:
    """``(group, logical topic, physical topic, partitions)`` for every group the catalog names."""
    out = []
    for topic in expand_catalog(config):
        if topic.is_dlq:
            continue
        pool = None
        if topic.spec.per_pool:
            head, _, tail = topic.spec.name.partition("{pool}")
            pool = topic.logical[len(head):len(topic.logical) - len(tail)]
        for group in topic.spec.consumers:
            out.append((group.format(pool=pool) if pool else group, topic.logical, topic.name, topic.partitions))
    return out


async def _end_offsets(client_kwargs: dict, tps: list[TopicPartition], broker: str) -> dict[TopicPartition, int]:
    consumer = AIOKafkaConsumer(enable_auto_commit=False, fetch_max_wait_ms=10, max_partition_fetch_bytes=1024,
                                **client_kwargs)
    await consumer.start()
    try:
        found = await partitions_of(consumer, sorted({tp.topic for tp in tps}))
        existing = {tp for partitions in found.values() for tp in partitions}
        tps = [tp for tp in tps if tp in existing]
        if broker != "tansu":  # a topic that does not exist has no end (and no row)
            return await consumer.end_offsets(tps) if tps else {}
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
    finally:
        await consumer.stop()


async def _committed(client_kwargs: dict, group_id: str, tps: list[TopicPartition]) -> dict[TopicPartition, int | None]:
    consumer = AIOKafkaConsumer(group_id=group_id, enable_auto_commit=False, **client_kwargs)
    await consumer.start()
    try:
        return {tp: await consumer.committed(tp) for tp in tps}
    finally:
        await consumer.stop()


async def consumer_lag(config: RollartConfig, endpoints: Endpoints) -> list[LagRow]:
    kwargs = {"client_id": f"{config.kafka.client_id}-lag", **kafka_client_kwargs(config.kafka, endpoints.kafka_bootstrap)}
    pairs = group_topics(config)
    tps = sorted({TopicPartition(physical, p) for _, _, physical, n in pairs for p in range(n)})
    ends = await _end_offsets(kwargs, tps, endpoints.broker)
    groups = sorted({g for g, *_ in pairs})
    committed = await asyncio.gather(*(
        _committed(kwargs, f"{config.job}.{g}", [TopicPartition(phys, p) for grp, _, phys, n in pairs
                                                 if grp == g for p in range(n)]) for g in groups))
    by_group = dict(zip(groups, committed))
    rows = [LagRow(group, logical, p, by_group[group][TopicPartition(physical, p)], ends[TopicPartition(physical, p)])
            for group, logical, physical, n in pairs for p in range(n) if TopicPartition(physical, p) in ends]
    for row in rows:
        GROUP_LAG.labels(config.job, row.group, row.topic, str(row.partition)).set(row.lag)
    return rows
