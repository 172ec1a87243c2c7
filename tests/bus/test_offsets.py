"""The commit watermark never passes an unfinished message."""

from aiokafka.structs import TopicPartition

from rollart.bus.offsets import OffsetTracker

TP = TopicPartition("t", 0)


def test_watermark_waits_for_the_lowest_unfinished_offset():
    tracker = OffsetTracker()
    for offset in (5, 6, 7):
        tracker.dispatch(TP, offset)
    tracker.done(TP, 7)
    tracker.done(TP, 6)
    assert tracker.to_commit() == {TP: 5}  # 5 is still running
    tracker.done(TP, 5)
    assert tracker.to_commit() == {TP: 8}
    tracker.committed({TP: 8})
    assert tracker.to_commit() == {}, "nothing new to commit"


def test_forget_drops_revoked_partitions_and_in_flight_counts():
    other = TopicPartition("t", 1)
    tracker = OffsetTracker()
    tracker.dispatch(TP, 0)
    tracker.dispatch(other, 10)
    assert tracker.in_flight() == 2
    tracker.forget({TP})
    assert tracker.to_commit() == {other: 10}
    assert tracker.to_commit(only={TP}) == {}
