"""What a consumer loop needs from a broker, as a protocol with two implementations.

:class:`GroupConsumer` is the consumer-group member the loop drives: subscribe with assign/revoke
callbacks, fetch, pause/resume, commit offsets with metadata and read them back. Apache Kafka and
Tansu are served by :mod:`rollart.bus.kafka` (aiokafka); :mod:`rollart.bus.memory` is an in-process
broker that keeps the same contract, so handler and loop tests run without a broker.

The record types are aiokafka's plain data classes (named tuples and a dataclass, no I/O): every
backend produces them, so handlers, the DLQ and the offset tracker see one vocabulary.
"""

from __future__ import annotations

from typing import Protocol

from aiokafka.structs import ConsumerRecord, OffsetAndMetadata, RecordMetadata, TopicPartition

__all__ = ["CommitFailed", "ConsumerRecord", "GroupConsumer", "OffsetAndMetadata", "RebalanceListener",
           "RecordMetadata", "TopicPartition"]

Records = dict[TopicPartition, list[ConsumerRecord]]


class CommitFailed(Exception):
    """The group no longer lets this member commit (a rebalance took its partitions, or the broker
    refused the commit): the new owner redelivers what was not committed."""


class RebalanceListener(Protocol):
    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None: ...

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None: ...


class GroupConsumer(Protocol):
    """One member of a consumer group (no auto-commit; a new partition starts at its committed offset,
    else at its earliest record)."""

    def subscribe(self, topics: list[str], listener: RebalanceListener) -> None: ...

    async def start(self) -> None: ...

    async def stop(self) -> None:
        """Leave the group (its partitions go to the other members)."""

    async def getmany(self, *, timeout_ms: int, max_records: int | None = None) -> Records:
        """Records of assigned, unpaused partitions; waits up to ``timeout_ms`` for some. Rebalance
        callbacks may run inside it (and must, eventually: a member that stops calling it stalls
        the group's rebalances)."""

    def pause(self, *tps: TopicPartition) -> None: ...

    def resume(self, *tps: TopicPartition) -> None: ...

    def paused(self) -> set[TopicPartition]: ...

    def assignment(self) -> set[TopicPartition]: ...

    async def commit(self, offsets: dict[TopicPartition, OffsetAndMetadata]) -> None:
        """Commit ``offsets`` with their metadata; raises :class:`CommitFailed` when refused."""

    async def committed(self, tps: set[TopicPartition]) -> dict[TopicPartition, OffsetAndMetadata]:
        """The group's last commits of ``tps``, with their metadata (absent: never committed)."""

    def highwater(self, tp: TopicPartition) -> int | None:
        """The partition's end as last seen by a fetch (None before the first)."""
