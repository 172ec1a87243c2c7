"""An in-process broker with the consumer-group contract of :mod:`rollart.bus.backend`.

Endpoints whose broker is ``"memory"`` and whose bootstrap is ``memory://<name>`` reach the broker
of that name in this process (created on first use): the consumer loop, the producer, the log reader
and topic creation then work without Kafka, so handler tests and the broker contract run in-process.

What it keeps of Kafka: partitioned, append-only topics (keyed records hash to a partition like
Kafka's default partitioner; unknown topics are created on first produce with one partition);
consumer groups whose members split the partitions round-robin and rebalance eagerly when a member
joins or leaves (every member revokes, then the new assignment is handed out, so a partition never
has two owners); committed offsets with metadata; a commit from a member that no longer owns the
partition fails. What it leaves out: transactions, retention, session timeouts (a member is gone
when it stops; one that stops taking part in rebalances is dropped after ``REBALANCE_TIMEOUT_S``).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

from aiokafka.partitioner import murmur2

from rollart.bus.backend import (CommitFailed, ConsumerRecord, OffsetAndMetadata, RebalanceListener, RecordMetadata,
                                 Records, TopicPartition)
from rollart.timeouts import wait_for

SCHEME = "memory://"
REBALANCE_TIMEOUT_S = 30.0


class InMemoryBroker:
    _brokers: ClassVar[dict[str, "InMemoryBroker"]] = {}

    def __init__(self) -> None:
        self._logs: dict[str, list[list[ConsumerRecord]]] = {}
        self._groups: dict[str, _Group] = {}
        self._waiters: set[asyncio.Future[None]] = set()
        self._round_robin = itertools.count()

    @classmethod
    def at(cls, bootstrap: str) -> "InMemoryBroker":
        """The broker of this process that ``memory://<name>`` names (created on first use)."""
        if not bootstrap.startswith(SCHEME):
            raise ValueError(f"an in-memory broker's bootstrap is {SCHEME}<name>, not {bootstrap!r}")
        return cls._brokers.setdefault(bootstrap, cls())

    # -- topics ----------------------------------------------------------------------------------

    def create_topic(self, name: str, partitions: int = 1) -> bool:
        """Create ``name`` (False: it exists already; its partitions are left as they are)."""
        if name in self._logs:
            return False
        self._logs[name] = [[] for _ in range(partitions)]
        for group in self._groups.values():
            if name in group.topics():
                group.changed()  # its members rebalance over the new partitions, as Kafka's metadata refresh does
        self._wake()
        return True

    def delete_topic(self, name: str) -> None:
        self._logs.pop(name, None)

    def topics(self) -> list[str]:
        return sorted(self._logs)

    def partitions(self, topic: str) -> list[TopicPartition]:
        return [TopicPartition(topic, p) for p in range(len(self._logs.get(topic, ())))]

    def end(self, tp: TopicPartition) -> int:
        return len(self._log(tp))

    def records(self, tp: TopicPartition, start: int, limit: int | None = None) -> list[ConsumerRecord]:
        log = self._log(tp)
        return log[start:] if limit is None else log[start:start + limit]

    def _log(self, tp: TopicPartition) -> list[ConsumerRecord]:
        partitions = self._logs.get(tp.topic, [])
        return partitions[tp.partition] if 0 <= tp.partition < len(partitions) else []

    def append(self, topic: str, value: bytes | None, *, key: bytes | None = None,
               headers: Sequence[tuple[str, bytes]] = (), partition: int | None = None) -> RecordMetadata:
        if topic not in self._logs:
            self.create_topic(topic)  # Kafka's auto.create.topics.enable
        partitions = self._logs[topic]
        if partition is None:
            partition = (murmur2(key) & 0x7FFFFFFF if key is not None else next(self._round_robin)) % len(partitions)
        elif not 0 <= partition < len(partitions):
            raise ValueError(f"{topic} has no partition {partition}")
        log = partitions[partition]
        timestamp = int(time.time() * 1000)
        log.append(ConsumerRecord(topic, partition, len(log), timestamp, 0, key, value, None,
                                  -1 if key is None else len(key), -1 if value is None else len(value),
                                  tuple(headers)))
        self._wake()
        tp = TopicPartition(topic, partition)
        return RecordMetadata(topic, partition, tp, len(log) - 1, timestamp, 0, 0)

    # -- waiting for news (records, group changes) -----------------------------------------------

    async def wait_for_change(self, timeout_s: float) -> None:
        """Return on the next append or group change, or after ``timeout_s``."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.add(waiter)
        try:
            await wait_for(waiter, timeout_s)
        except asyncio.TimeoutError:
            pass
        finally:
            self._waiters.discard(waiter)

    def _wake(self) -> None:
        for waiter in list(self._waiters):
            if not waiter.done() and not waiter.get_loop().is_closed():
                waiter.set_result(None)

    # -- clients ---------------------------------------------------------------------------------

    def group(self, group_id: str) -> "_Group":
        return self._groups.setdefault(group_id, _Group(self))

    def committed(self, group_id: str, tps: list[TopicPartition]) -> dict[TopicPartition, OffsetAndMetadata]:
        """A group's last commits of ``tps``, read without joining it (Kafka's OffsetFetch)."""
        group = self._groups.get(group_id)
        return {} if group is None else {tp: group.committed[tp] for tp in tps if tp in group.committed}

    def consumer(self, group_id: str, *, client_id: str = "memory") -> "MemoryGroupConsumer":
        return MemoryGroupConsumer(self, group_id, client_id)

    def producer(self) -> "MemoryProducer":
        return MemoryProducer(self)


@dataclass
class _Group:
    broker: InMemoryBroker
    members: dict[str, "MemoryGroupConsumer"] = field(default_factory=dict)
    joined: dict[str, int] = field(default_factory=dict)  # member id -> the generation it rejoined for
    generation: int = 0
    committed: dict[TopicPartition, OffsetAndMetadata] = field(default_factory=dict)
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    def topics(self) -> set[str]:
        return {t for member in self.members.values() for t in member.topics}

    def join(self, member: "MemoryGroupConsumer") -> str:
        member_id = f"{member.client_id}-{next(self._ids)}"
        self.members[member_id] = member
        self.changed()
        return member_id

    def leave(self, member_id: str) -> None:
        self.members.pop(member_id, None)
        self.joined.pop(member_id, None)
        self.changed()

    def changed(self) -> None:
        self.generation += 1
        self.broker._wake()

    def all_joined(self, generation: int) -> bool:
        return all(self.joined.get(member_id) == generation for member_id in self.members)

    def drop_laggards(self, generation: int) -> None:
        """Members that did not rejoin within the rebalance timeout leave (Kafka does the same)."""
        for member_id in [m for m in self.members if self.joined.get(m) != generation]:
            self.leave(member_id)

    def assignment(self, member_id: str) -> set[TopicPartition]:
        """Round-robin over the partitions of the subscribed topics, members in join order."""
        members = sorted(self.members, key=lambda m: int(m.rsplit("-", 1)[1]))
        tps = sorted(tp for topic in self.topics() for tp in self.broker.partitions(topic))
        owners = itertools.cycle(members)
        mine = set()
        for tp in tps:
            owner = next(owners)
            while tp.topic not in self.members[owner].topics:  # subscriptions may differ
                owner = next(owners)
            if owner == member_id:
                mine.add(tp)
        return mine


class MemoryGroupConsumer:
    """A member of a group on an :class:`InMemoryBroker` (see the module docstring)."""

    def __init__(self, broker: InMemoryBroker, group_id: str, client_id: str):
        self.broker = broker
        self.group = broker.group(group_id)
        self.client_id = client_id
        self.topics: set[str] = set()
        self._listener: RebalanceListener | None = None
        self._member_id: str | None = None
        self._generation = -1
        self._assigned: set[TopicPartition] = set()
        self._positions: dict[TopicPartition, int] = {}
        self._paused: set[TopicPartition] = set()

    def subscribe(self, topics: list[str], listener: RebalanceListener) -> None:
        self.topics, self._listener = set(topics), listener

    async def start(self) -> None:
        self._member_id = self.group.join(self)

    async def stop(self) -> None:
        if self._member_id is not None:
            self.group.leave(self._member_id)
            self._member_id = None
            self._assigned, self._positions = set(), {}

    async def getmany(self, *, timeout_ms: int, max_records: int | None = None) -> Records:
        await self._follow_rebalance()
        records = self._fetch(max_records)
        if records or timeout_ms <= 0:
            return records
        await self.broker.wait_for_change(timeout_ms / 1000)
        await self._follow_rebalance()
        return self._fetch(max_records)

    def _fetch(self, max_records: int | None) -> Records:
        out: Records = {}
        budget = max_records if max_records is not None else 500
        for tp in sorted(self._assigned - self._paused):
            if budget <= 0:
                break
            records = self.broker.records(tp, self._positions[tp], budget)
            if records:
                out[tp] = records
                self._positions[tp] += len(records)
                budget -= len(records)
        return out

    async def _follow_rebalance(self) -> None:
        """Eager rebalancing: revoke everything, wait until every member did, take the new share."""
        while self._member_id is not None and self._generation != self.group.generation:
            if self._member_id not in self.group.members:  # dropped for missing a rebalance: join anew
                self._member_id = self.group.join(self)
            generation = self.group.generation
            if self._listener is not None and self._generation >= 0:
                await self._listener.on_partitions_revoked(set(self._assigned))
            self._assigned, self._positions = set(), {}
            self.group.joined[self._member_id] = generation
            deadline = time.monotonic() + REBALANCE_TIMEOUT_S
            while self.group.generation == generation and not self.group.all_joined(generation):
                if time.monotonic() > deadline:
                    self.group.drop_laggards(generation)
                    break
                await self.broker.wait_for_change(0.05)
            if self.group.generation != generation:
                continue  # the group changed again meanwhile: rejoin
            await self._take_assignment(generation)

    async def _take_assignment(self, generation: int) -> None:
        assert self._member_id is not None
        self._generation = generation
        self._assigned = self.group.assignment(self._member_id)
        self._paused = set()  # a new assignment starts unpaused, as in aiokafka
        for tp in self._assigned:
            committed = self.group.committed.get(tp)
            self._positions[tp] = committed.offset if committed is not None else 0
        if self._listener is not None:
            await self._listener.on_partitions_assigned(set(self._assigned))

    def pause(self, *tps: TopicPartition) -> None:
        self._paused.update(tp for tp in tps if tp in self._assigned)

    def resume(self, *tps: TopicPartition) -> None:
        self._paused.difference_update(tps)

    def paused(self) -> set[TopicPartition]:
        return set(self._paused)

    def assignment(self) -> set[TopicPartition]:
        return set(self._assigned)

    async def commit(self, offsets: dict[TopicPartition, OffsetAndMetadata]) -> None:
        foreign = sorted(tp for tp in offsets if tp not in self._assigned)
        if self._member_id not in self.group.members or foreign:  # left, or dropped: a zombie's commit
            raise CommitFailed(f"{self.client_id} does not own {foreign or 'anything'} any more")
        self.group.committed.update(offsets)

    async def committed(self, tps: set[TopicPartition]) -> dict[TopicPartition, OffsetAndMetadata]:
        return {tp: self.group.committed[tp] for tp in tps if tp in self.group.committed}

    def highwater(self, tp: TopicPartition) -> int | None:
        return self.broker.end(tp)


class MemoryProducer:
    """The part of AIOKafkaProducer that :class:`~rollart.bus.producer.BusProducer` uses."""

    def __init__(self, broker: InMemoryBroker):
        self.broker = broker

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def send(self, topic: str, value: bytes | None, *, key: bytes | None = None,
                   headers: Sequence[tuple[str, bytes]] = (), partition: int | None = None,
                   ) -> asyncio.Future[RecordMetadata]:
        ack: asyncio.Future[RecordMetadata] = asyncio.get_running_loop().create_future()
        ack.set_result(self.broker.append(topic, value, key=key, headers=headers, partition=partition))
        return ack

    async def begin_transaction(self) -> None:
        raise NotImplementedError("the in-memory broker has no transactions (use Apache Kafka)")

    async def send_offsets_to_transaction(self, offsets: Any, group_id: str) -> None:
        raise NotImplementedError("the in-memory broker has no transactions (use Apache Kafka)")

    async def commit_transaction(self) -> None:
        raise NotImplementedError("the in-memory broker has no transactions (use Apache Kafka)")
