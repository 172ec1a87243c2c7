"""The aiokafka backend of :class:`~rollart.bus.backend.GroupConsumer`: Apache Kafka and Tansu."""

from __future__ import annotations

from typing import Iterable

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener
from aiokafka.errors import CommitFailedError, KafkaError

from rollart.bus.backend import CommitFailed, GroupConsumer, OffsetAndMetadata, RebalanceListener, Records, TopicPartition
from rollart.bus.transaction import isolation_level
from rollart.bus.memory import InMemoryBroker
from rollart.config import RollartConfig
from rollart.endpoints import Endpoints, kafka_client_kwargs


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]  # aiokafka ships no types
    def __init__(self, listener: RebalanceListener):
        self._listener = listener

    async def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        await self._listener.on_partitions_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        await self._listener.on_partitions_assigned(set(assigned))


class KafkaGroupConsumer:
    """An :class:`AIOKafkaConsumer` in a group, with manual commits that carry metadata."""

    def __init__(self, consumer: AIOKafkaConsumer):
        self.kafka = consumer

    def subscribe(self, topics: list[str], listener: RebalanceListener) -> None:
        self.kafka.subscribe(topics, listener=_Listener(listener))

    async def start(self) -> None:
        await self.kafka.start()

    async def stop(self) -> None:
        await self.kafka.stop()

    async def getmany(self, *, timeout_ms: int, max_records: int | None = None) -> Records:
        return await self.kafka.getmany(timeout_ms=timeout_ms, max_records=max_records)  # type: ignore[no-any-return]

    def pause(self, *tps: TopicPartition) -> None:
        self.kafka.pause(*tps)

    def resume(self, *tps: TopicPartition) -> None:
        self.kafka.resume(*tps)

    def paused(self) -> set[TopicPartition]:
        return set(self.kafka.paused())

    def assignment(self) -> set[TopicPartition]:
        return set(self.kafka.assignment())

    async def commit(self, offsets: dict[TopicPartition, OffsetAndMetadata]) -> None:
        try:
            await self.kafka.commit(offsets)
        except (CommitFailedError, KafkaError) as exc:
            raise CommitFailed(str(exc)) from exc

    async def committed(self, tps: set[TopicPartition]) -> dict[TopicPartition, OffsetAndMetadata]:
        if not tps:
            return {}
        # The coordinator's own fetch (what consumer.committed() calls) is the one that returns metadata.
        return await self.kafka._coordinator.fetch_committed_offsets(list(tps))  # type: ignore[no-any-return]

    def highwater(self, tp: TopicPartition) -> int | None:
        return self.kafka.highwater(tp)  # type: ignore[no-any-return]


def kafka_group_consumer(config: RollartConfig, endpoints: Endpoints, group_id: str, *, client_id: str,
                         fetch_max_wait_ms: int, fetch_min_bytes: int = 1) -> GroupConsumer:
    return KafkaGroupConsumer(AIOKafkaConsumer(
        group_id=group_id,
        client_id=client_id,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=fetch_max_wait_ms,
        fetch_min_bytes=fetch_min_bytes,
        session_timeout_ms=config.bus.session_timeout_ms,
        heartbeat_interval_ms=config.bus.heartbeat_interval_ms,
        max_partition_fetch_bytes=config.bus.max_value_bytes,
        fetch_max_bytes=max(config.bus.max_value_bytes, 52428800),
        isolation_level=isolation_level(config),
        **kafka_client_kwargs(config.kafka, endpoints.kafka_bootstrap),
    ))


def group_consumer(config: RollartConfig, endpoints: Endpoints, group_id: str, *, client_id: str,
                   fetch_max_wait_ms: int, fetch_min_bytes: int = 1) -> GroupConsumer:
    """A member of ``group_id`` on the endpoints' broker (a ``memory://`` bootstrap: the in-process one).
    ``fetch_min_bytes``: the broker holds a fetch until that much is there (or ``fetch_max_wait_ms``
    passed), for a consumer that reads in bulk rather than at once."""
    if endpoints.broker == "memory":
        return InMemoryBroker.at(endpoints.kafka_bootstrap).consumer(group_id, client_id=client_id)
    return kafka_group_consumer(config, endpoints, group_id, client_id=client_id, fetch_max_wait_ms=fetch_max_wait_ms,
                                fetch_min_bytes=fetch_min_bytes)
