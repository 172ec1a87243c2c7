"""Which offsets are safe to commit when messages finish out of order, and which are done past them.

Handlers run concurrently, so offset 7 may finish before offset 5. The committable offset of a
partition is the lowest offset still in flight (everything below it is done), or one past the highest
dispatched offset when nothing is in flight. Committing it never skips an unfinished message.

It does redo finished ones: offsets 6 and 7, done while 5 was in flight, are redelivered from 5 after
a restart. Under exactly-once that is a duplicate, not a redelivery: their outputs were committed
(in the transaction that also committed offset 5) and the redo commits them again (the env stage,
whose groups take seconds to minutes and finish in any order, did this to a chaos campaign). So each
commit also records the offsets done past the committed one, as ranges in the commit's metadata (the
approach of Confluent's parallel consumer): ``rollart.done=1-2,5`` above committed offset 5 says 6, 7
and 10 are done. The metadata commits with the offset (in the transaction, under exactly-once), and
the next owner of the partition reads it on assignment and skips those offsets. In-flight offsets are
bounded (``bus.max_in_flight``), so the ranges are too; past ``MAX_METADATA_CHARS`` the farthest
ranges are left out (those offsets are redone, as before), with a warning.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from rollart.bus.backend import OffsetAndMetadata, TopicPartition

log = logging.getLogger(__name__)

PREFIX = "rollart.done="
MAX_METADATA_CHARS = 3500  # the broker's offset.metadata.max.bytes defaults to 4096

Ranges = list[tuple[int, int]]  # inclusive (first, last), ascending, disjoint


def encode_done(base: int, ranges: Ranges) -> str:
    """Offsets done at or past ``base`` as metadata, relative to ``base`` (short)."""
    parts: list[str] = []
    size = len(PREFIX)
    for first, last in ranges:
        part = str(first - base) if first == last else f"{first - base}-{last - base}"
        if size + len(part) + 1 > MAX_METADATA_CHARS:
            log.warning("offset metadata full: %d ranges of done offsets past %d left out (they will be redone)",
                        len(ranges) - len(parts), base)
            break
        parts.append(part)
        size += len(part) + 1
    return PREFIX + ",".join(parts) if parts else ""


def decode_done(base: int, metadata: str | None) -> Ranges:
    """The done ranges a commit's metadata names ([] for metadata not written by rollart)."""
    if not metadata or not metadata.startswith(PREFIX):
        return []
    ranges = []
    try:
        for part in filter(None, metadata[len(PREFIX):].split(",")):
            first, _, last = part.partition("-")
            ranges.append((base + int(first), base + int(last or first)))
    except ValueError:
        log.warning("unreadable done offsets in commit metadata %r: ignored (they will be redone)", metadata[:80])
        return []
    return ranges


@dataclass
class PartitionOffsets:
    pending: set[int] = field(default_factory=set)
    next_offset: int | None = None  # one past the highest dispatched offset
    committed: tuple[int, str] | None = None  # (offset, metadata) last committed
    ahead: Ranges = field(default_factory=list)  # done past next_offset, as a previous owner committed

    def committable(self) -> int | None:
        if self.pending:
            return min(self.pending)
        return self.next_offset

    def done_ranges(self, base: int) -> Ranges:
        """Offsets at or past ``base`` that need no redo: the gaps between in-flight offsets below
        next_offset (done, or no record there), then the inherited ranges not reached yet."""
        ranges, start = [], base
        for offset in sorted(self.pending):
            if offset > start:
                ranges.append((start, offset - 1))
            start = offset + 1
        if self.next_offset is not None and start < self.next_offset:
            ranges.append((start, self.next_offset - 1))
        reached = self.next_offset if self.next_offset is not None else base
        for first, last in self.ahead:
            if last >= reached:
                ranges.append((max(first, reached), last))
        merged: Ranges = []
        for first, last in ranges:
            if merged and first <= merged[-1][1] + 1:
                merged[-1] = (merged[-1][0], max(merged[-1][1], last))
            else:
                merged.append((first, last))
        return merged


class OffsetTracker:
    def __init__(self) -> None:
        self._parts: dict[TopicPartition, PartitionOffsets] = {}

    def resume(self, tp: TopicPartition, committed: OffsetAndMetadata | None) -> None:
        """A newly assigned partition: its last commit, and the done offsets past it that it names."""
        part = self._parts[tp] = PartitionOffsets()
        if committed is not None and committed.offset is not None and committed.offset >= 0:
            part.committed = (committed.offset, committed.metadata or "")
            part.ahead = decode_done(committed.offset, committed.metadata)

    def already_done(self, tp: TopicPartition, offset: int) -> bool:
        """Done by an earlier owner past its committed offset (see the module docstring)."""
        part = self._parts.get(tp)
        return part is not None and any(first <= offset <= last for first, last in part.ahead)

    def dispatch(self, tp: TopicPartition, offset: int) -> None:
        part = self._parts.setdefault(tp, PartitionOffsets())
        part.pending.add(offset)
        if part.next_offset is None or offset + 1 > part.next_offset:
            part.next_offset = offset + 1

    def done(self, tp: TopicPartition, offset: int) -> None:
        part = self._parts.get(tp)
        if part is not None:
            part.pending.discard(offset)

    def to_commit(self, only: set[TopicPartition] | None = None) -> dict[TopicPartition, OffsetAndMetadata]:
        """Offsets, with the done ranges past them, that changed since the last commit."""
        out = {}
        for tp, part in self._parts.items():
            if only is not None and tp not in only:
                continue
            offset = part.committable()
            if offset is None:
                continue
            metadata = encode_done(offset, part.done_ranges(offset))
            if (offset, metadata) != part.committed:
                out[tp] = OffsetAndMetadata(offset, metadata)
        return out

    def committed(self, offsets: dict[TopicPartition, OffsetAndMetadata]) -> None:
        for tp, committed in offsets.items():
            if tp in self._parts:
                self._parts[tp].committed = (committed.offset, committed.metadata)

    def forget(self, tps: set[TopicPartition]) -> None:
        for tp in tps:
            self._parts.pop(tp, None)

    def in_flight(self) -> int:
        return sum(len(p.pending) for p in self._parts.values())
