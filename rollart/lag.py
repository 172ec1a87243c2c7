"""Consumer-group lag per topic and partition: end offset minus committed offset.

The groups of a topic are the ``consumers`` of its catalog entry (``gen-{pool}`` expanded per pool),
named ``<job>.<group>`` on the broker. Committed offsets come from an OffsetFetch of each group
(without joining it, so nothing rebalances); end offsets from ListOffsets (latest), as Kafka's own
``kafka-consumer-groups --describe`` computes them. On Tansu, whose ListOffsets undercounts, from
the high watermark of a fetch instead (see the README's broker notes). Both look-ups are the log
reader's (:mod:`rollart.bus.reader`), so lag reads the in-memory broker too.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from prometheus_client import Gauge

from rollart.bus.backend import TopicPartition
from rollart.bus.reader import committed_offsets, end_offsets
from rollart.config import RollartConfig
from rollart.endpoints import Endpoints
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


async def consumer_lag(config: RollartConfig, endpoints: Endpoints) -> list[LagRow]:
    client_id = f"{config.kafka.client_id}-lag"
    pairs = group_topics(config)
    tps = sorted({TopicPartition(physical, p) for _, _, physical, n in pairs for p in range(n)})
    ends = await end_offsets(config, endpoints, tps, client_id=client_id)
    groups = sorted({g for g, *_ in pairs})
    committed = await asyncio.gather(*(
        committed_offsets(config, endpoints, f"{config.job}.{g}", [TopicPartition(phys, p) for grp, _, phys, n in pairs
                                                                   if grp == g for p in range(n)], client_id=client_id)
        for g in groups))
    by_group = dict(zip(groups, committed))
    rows = [LagRow(group, logical, p, by_group[group][TopicPartition(physical, p)], ends[TopicPartition(physical, p)])
            for group, logical, physical, n in pairs for p in range(n) if TopicPartition(physical, p) in ends]
    for row in rows:
        GROUP_LAG.labels(config.job, row.group, row.topic, str(row.partition)).set(row.lag)
    return rows
