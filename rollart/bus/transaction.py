"""Exactly-once for one consumer loop: its outputs and its input offsets in one Kafka transaction.

A loop with a transaction defers each handler's outputs until the handler returned (a failed attempt
sends nothing), then, under the transaction's lock, sends them and marks the input done. Every
commit interval the loop commits the transaction with the offsets of everything done: consumers
reading committed records see the outputs exactly when the inputs count as consumed, never twice and
never without them. Batching per commit interval, not per message, keeps the cost to one
transaction round trip per interval.

Fencing: the transactional id is ``<job>.<group>.<member>``; a member that keeps its name across
restarts (``ROLLART_MEMBER``: the local runner's stage names, a StatefulSet's pod names) fences its
previous incarnation and aborts what that left open, at once. aiokafka does not implement KIP-447
(group-generation fencing of offset commits), so a member whose name changes relies on the broker
aborting its predecessor's open transaction after ``transaction.timeout.ms``.
"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any, Callable

from rollart.bus.backend import OffsetAndMetadata, TopicPartition
from rollart.bus.producer import BusProducer
from rollart.config import RollartConfig

MEMBER_ENV = "ROLLART_MEMBER"


def exactly_once(config: RollartConfig) -> bool:
    return config.bus.processing_guarantee == "exactly_once"


def isolation_level(config: RollartConfig) -> str:
    """Consumers skip aborted transactions' records under exactly-once (and read up to the last
    stable offset); records written outside transactions are visible at once either way."""
    return "read_committed" if exactly_once(config) else "read_uncommitted"


def member_name() -> str:
    return os.environ.get(MEMBER_ENV) or f"{socket.gethostname()}-{os.getpid()}"


def transactional_id(config: RollartConfig, group: str) -> str | None:
    """The id of ``group``'s transactional producer in this member, or None under at-least-once."""
    return f"{config.job}.{group}.{member_name()}" if exactly_once(config) else None


class Transaction:
    def __init__(self, producer: BusProducer, group_id: str):
        self.producer = producer
        self.group_id = group_id
        self._lock = asyncio.Lock()
        self._acks: list[asyncio.Future[Any]] = []  # the open transaction's records

    async def open(self) -> None:
        await self.producer.start()  # InitProducerId: fences an older producer with the same id
        await self.producer.begin_transaction()

    async def add(self, outputs: list[tuple[str, Any, dict[str, Any]]], mark_done: Callable[[], None]) -> None:
        """Send one input's outputs into the open transaction and mark the input done, with no
        commit in between."""
        async with self._lock:
            for topic, message, options in outputs:
                self._acks.append(await self.producer.send(topic, message, **options))
            mark_done()

    async def commit(self, to_commit: Callable[[], dict[TopicPartition, OffsetAndMetadata]]
                     ) -> dict[TopicPartition, OffsetAndMetadata]:
        """Commit the open transaction with the offsets ``to_commit()`` gives under the lock; returns
        them. Nothing is committed when nothing was sent and no offset moved."""
        async with self._lock:
            offsets = to_commit()
            if not offsets and not self._acks:
                return {}
            # Every record must be acknowledged first: a batch the producer gave up on (a broker down
            # past its delivery timeout) would otherwise leave its inputs' offsets committed without it.
            for outcome in await asyncio.gather(*self._acks, return_exceptions=True):
                if isinstance(outcome, BaseException):
                    raise outcome
            await self.producer.commit_transaction(offsets, self.group_id)
            self._acks = []
            await self.producer.begin_transaction()
            return offsets

    async def close(self) -> None:
        await self.producer.stop()
