"""Commit policies: when a handled input counts as done, and how its offset reaches the group.

Both track offsets with :class:`~rollart.bus.offsets.OffsetTracker` (watermarks, plus the offsets done
past them in the commit's metadata) and commit every ``bus.commit_interval_s``:

* :class:`WatermarkCommits` (at-least-once): an input is done when its handler and acks are; a commit
  writes the de-duplication marks first, then the offsets. A commit the group refuses (a rebalance
  took the partitions) is logged: the new owner redelivers, the marks absorb it.
* :class:`TransactionalCommits` (exactly-once, :mod:`rollart.bus.transaction`): an input is done when
  its outputs are in the open transaction; a commit commits the transaction with every done offset.
  A failed commit is fatal: the loop stops, and the restarted member redoes the aborted inputs.
"""

from __future__ import annotations

import logging
from typing import Callable, Protocol

from rollart.bus.backend import CommitFailed, GroupConsumer, OffsetAndMetadata, TopicPartition
from rollart.bus.dedup import Deduplicator
from rollart.bus.offsets import OffsetTracker
from rollart.bus.steps import Output
from rollart.bus.transaction import Transaction

log = logging.getLogger(__name__)

Offsets = dict[TopicPartition, OffsetAndMetadata]


class CommitPolicy(Protocol):
    tracker: OffsetTracker

    async def complete(self, tp: TopicPartition, offset: int, outputs: list[Output]) -> None:
        """The input at ``offset`` was handled; ``outputs`` are what a transaction still has to send."""

    async def commit(self, only: set[TopicPartition] | None = None) -> Offsets:
        """Commit what is done (of ``only``, where the policy can); returns what was committed."""


class WatermarkCommits:
    def __init__(self, tracker: OffsetTracker, consumer: GroupConsumer, dedup: Deduplicator | None, group: str):
        self.tracker = tracker
        self.consumer = consumer
        self.dedup = dedup
        self.group = group

    async def complete(self, tp: TopicPartition, offset: int, outputs: list[Output]) -> None:
        self.tracker.done(tp, offset)  # outputs were produced and acked by the handler's attempt

    async def commit(self, only: set[TopicPartition] | None = None) -> Offsets:
        offsets = self.tracker.to_commit(only)
        if not offsets:
            return {}
        if self.dedup is not None:
            await self.dedup.flush()  # marks first: a crash after this point dedups the redelivery
        try:
            await self.consumer.commit(offsets)
        except CommitFailed as exc:
            log.warning("%s: commit failed (%s); messages will be redelivered and de-duplicated", self.group, exc)
            return {}
        self.tracker.committed(offsets)
        return offsets


class TransactionalCommits:
    def __init__(self, tracker: OffsetTracker, transaction: Transaction, group: str,
                 on_fatal: Callable[[BaseException], None]):
        self.tracker = tracker
        self.transaction = transaction
        self.group = group
        self.on_fatal = on_fatal

    async def complete(self, tp: TopicPartition, offset: int, outputs: list[Output]) -> None:
        await self.transaction.add(outputs, lambda: self.tracker.done(tp, offset))

    async def commit(self, only: set[TopicPartition] | None = None) -> Offsets:
        """Every partition, whatever ``only`` says: the others' outputs are in the same transaction."""
        try:
            offsets = await self.transaction.commit(self.tracker.to_commit)
        except Exception as exc:  # noqa: BLE001 - a record or the commit failed: never commit around it
            log.error("%s: transaction commit failed (%s); stopping, its inputs will be redone", self.group, exc)
            self.on_fatal(exc)
            return {}
        if offsets:
            self.tracker.committed(offsets)
        return offsets
