"""Which offsets are safe to commit when messages finish out of order.

Handlers run concurrently, so offset 7 may finish before offset 5. The committable offset of a
partition is the lowest offset still in flight (everything below it is done), or one past the highest
dispatched offset when nothing is in flight. Committing it never skips an unfinished message.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aiokafka.structs import TopicPartition


@dataclass
class PartitionOffsets:
    pending: set[int] = field(default_factory=set)
    next_offset: int | None = None  # one past the highest dispatched offset
    committed: int | None = None

    def committable(self) -> int | None:
        if self.pending:
            return min(self.pending)
        return self.next_offset


class OffsetTracker:
    def __init__(self) -> None:
        self._parts: dict[TopicPartition, PartitionOffsets] = {}

    def dispatch(self, tp: TopicPartition, offset: int) -> None:
        part = self._parts.setdefault(tp, PartitionOffsets())
        part.pending.add(offset)
        if part.next_offset is None or offset + 1 > part.next_offset:
            part.next_offset = offset + 1

    def done(self, tp: TopicPartition, offset: int) -> None:
        part = self._parts.get(tp)
        if part is not None:
            part.pending.discard(offset)

    def to_commit(self, only: set[TopicPartition] | None = None) -> dict[TopicPartition, int]:
        """Offsets that moved since the last commit."""
        out = {}
        for tp, part in self._parts.items():
            if only is not None and tp not in only:
                continue
            offset = part.committable()
            if offset is not None and offset != part.committed:
                out[tp] = offset
        return out

    def committed(self, offsets: dict[TopicPartition, int]) -> None:
        for tp, offset in offsets.items():
            if tp in self._parts:
                self._parts[tp].committed = offset

    def forget(self, tps: set[TopicPartition]) -> None:
        for tp in tps:
            self._parts.pop(tp, None)

    def in_flight(self) -> int:
        return sum(len(p.pending) for p in self._parts.values())
