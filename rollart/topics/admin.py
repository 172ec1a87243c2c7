"""Apply the catalog to a broker: create what is missing, report what differs, change nothing else.

Existing topics are never altered here: repartitioning a keyed topic moves keys between partitions
(breaking trajectory ownership), so differences are reported for an operator to decide.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Literal

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import TopicAlreadyExistsError

from rollart.config import RollartConfig
from rollart.endpoints import Endpoints, kafka_client_kwargs
from rollart.topics.catalog import PhysicalTopic, expand_catalog
from rollart.timeouts import wait_for

TOPIC_ALREADY_EXISTS = TopicAlreadyExistsError.errno


@dataclass
class TopicReport:
    name: str
    action: Literal["created", "exists", "differs"]
    differences: list[str] = field(default_factory=list)


def admin_client(config: RollartConfig, endpoints: Endpoints) -> AIOKafkaAdminClient:
    return AIOKafkaAdminClient(client_id=f"{config.kafka.client_id}-admin",
                               **kafka_client_kwargs(config.kafka, endpoints.kafka_bootstrap))


async def broker_count(admin: AIOKafkaAdminClient) -> int:
    cluster = await admin.describe_cluster()
    return max(1, len(cluster.get("brokers", [])))


async def _describe(admin: AIOKafkaAdminClient, names: list[str],
                    settle_s: float = 5.0) -> tuple[dict[str, int], dict[str, dict[str, str]]]:
    partitions: dict[str, int] = {}
    deadline = asyncio.get_running_loop().time() + settle_s
    while True:  # a topic created a moment ago may not be in the broker's metadata cache yet
        for t in await admin.describe_topics([n for n in names if n not in partitions]):
            if t["error_code"] == 0:
                partitions[t["topic"]] = len(t["partitions"])
        if len(partitions) == len(names) or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.1)
    configs: dict[str, dict[str, str]] = {}
    responses = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, n) for n in names])
    for response in responses:
        for resource in response.resources:
            _, _, _, name, entries = resource[:5]
            configs[name] = {entry[0]: entry[1] for entry in entries}
    return partitions, configs


async def _served(config: RollartConfig, endpoints: Endpoints, topics: list[PhysicalTopic]) -> None:
    """Return once every partition of ``topics`` (created a moment ago) answers an offset request from
    its leader. The controller names a leader before that broker has taken the partition on, and a
    consumer that asks for offsets in between logs each NOT_LEADER answer as an ERROR (aiokafka's
    fetcher) before it retries; ``end_offsets`` retries quietly."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(client_id=f"{config.kafka.client_id}-admin", enable_auto_commit=False,
                                **kafka_client_kwargs(config.kafka, endpoints.kafka_bootstrap))
    await consumer.start()
    try:
        await consumer.end_offsets([TopicPartition(t.name, p) for t in topics for p in range(t.partitions)])
    finally:
        await consumer.stop()


def _differences(topic: PhysicalTopic, partitions: int | None, configs: dict[str, str]) -> list[str]:
    diffs = []
    if partitions is not None and partitions != topic.partitions:
        diffs.append(f"partitions: catalog {topic.partitions}, broker {partitions}")
    for key, want in topic.configs.items():
        have = configs.get(key)
        if have is not None and have != want:
            diffs.append(f"{key}: catalog {want}, broker {have}")
    return diffs


def _apply_in_memory(endpoints: Endpoints, topics: list[PhysicalTopic]) -> list[TopicReport]:
    """The in-memory broker (rollart.bus.memory) keeps partitions only: no configs to compare."""
    from rollart.bus.memory import InMemoryBroker

    broker = InMemoryBroker.at(endpoints.kafka_bootstrap)
    reports = []
    for t in topics:
        if broker.create_topic(t.name, t.partitions):
            reports.append(TopicReport(t.name, "created"))
        else:
            diffs = _differences(t, len(broker.partitions(t.name)), {})
            reports.append(TopicReport(t.name, "differs" if diffs else "exists", diffs))
    return reports


async def apply_topics(config: RollartConfig, endpoints: Endpoints, topics: list[PhysicalTopic] | None = None,
                       *, timeout_s: float = 30.0) -> list[TopicReport]:
    """Create missing topics (idempotent) and report differences of existing ones from the catalog."""
    topics = topics if topics is not None else expand_catalog(config)
    if endpoints.broker == "memory":
        return _apply_in_memory(endpoints, topics)
    admin = admin_client(config, endpoints)
    await wait_for(admin.start(), timeout_s)
    try:
        replication = min(config.kafka.replication_factor, await broker_count(admin))
        existing = set(await admin.list_topics())
        missing = [t for t in topics if t.name not in existing]
        reports: dict[str, TopicReport] = {}
        if missing:
            response = await admin.create_topics(
                [NewTopic(t.name, t.partitions, replication, topic_configs=t.configs) for t in missing])
            for name, code, message in response.topic_errors:
                if code == TOPIC_ALREADY_EXISTS:  # someone else's create won the race (or the list
                    existing.add(name)            # lagged it): compare it like any existing topic
                elif code != 0:
                    raise RuntimeError(f"creating topic {name} failed: error {code} {message}")
                else:
                    reports[name] = TopicReport(name, "created")
        created = [t for t in topics if t.name in reports]  # (so far only the created ones)
        if created:
            await wait_for(_served(config, endpoints, created), timeout_s)
        present = [t for t in topics if t.name in existing]
        if present:
            partitions, configs = await _describe(admin, [t.name for t in present])
            for t in present:
                diffs = _differences(t, partitions.get(t.name), configs.get(t.name, {}))
                reports[t.name] = TopicReport(t.name, "differs" if diffs else "exists", diffs)
        return [reports[t.name] for t in topics]
    finally:
        await admin.close()
