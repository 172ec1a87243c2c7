"""The commit watermark never passes an unfinished message, and the commit names what is done past it."""

from aiokafka.structs import OffsetAndMetadata as Committed, TopicPartition

from rollart.bus import offsets
from rollart.bus.offsets import OffsetTracker, decode_done, encode_done

TP = TopicPartition("t", 0)


def test_watermark_waits_for_the_lowest_unfinished_offset_and_names_the_done_ones_past_it():
    tracker = OffsetTracker()
    for offset in (5, 6, 7, 9):  # 8: no record there (a transaction marker)
        tracker.dispatch(TP, offset)
    tracker.done(TP, 7)
    tracker.done(TP, 9)
    assert tracker.to_commit() == {TP: Committed(5, "rollart.done=2-4")}  # 5 and 6 still running
    tracker.done(TP, 6)
    assert tracker.to_commit() == {TP: Committed(5, "rollart.done=1-4")}, "more done: the metadata moved"
    tracker.done(TP, 5)
    assert tracker.to_commit() == {TP: Committed(10, "")}
    tracker.committed({TP: Committed(10, "")})
    assert tracker.to_commit() == {}, "nothing new to commit"


def test_the_next_owner_skips_what_the_last_one_finished_past_its_commit():
    tracker = OffsetTracker()
    tracker.resume(TP, Committed(5, "rollart.done=2-4,7"))  # 7, 8, 9 and 12 were done
    assert [o for o in range(5, 14) if tracker.already_done(TP, o)] == [7, 8, 9, 12]
    assert tracker.to_commit() == {}, "resumed where it was committed: nothing to commit yet"
    for offset in (5, 6):
        tracker.dispatch(TP, offset)
    tracker.done(TP, 6)
    # until they are fetched again, the inherited ranges are kept in every commit
    assert tracker.to_commit() == {TP: Committed(5, "rollart.done=1-4,7")}
    tracker.done(TP, 5)
    assert tracker.to_commit() == {TP: Committed(7, "rollart.done=0-2,5")}


def test_metadata_is_bounded_and_foreign_metadata_is_ignored(monkeypatch):
    monkeypatch.setattr(offsets, "MAX_METADATA_CHARS", 40)
    text = encode_done(100, [(100 + 3 * i, 100 + 3 * i + 1) for i in range(20)])
    assert len(text) <= 40 and decode_done(100, text)[0] == (100, 101)
    assert decode_done(100, "") == [] and decode_done(100, "written by another tool") == []
    assert decode_done(100, "rollart.done=1-x") == [], "unreadable: redo rather than skip"


def test_forget_drops_revoked_partitions_and_in_flight_counts():
    other = TopicPartition("t", 1)
    tracker = OffsetTracker()
    tracker.dispatch(TP, 0)
    tracker.dispatch(other, 10)
    assert tracker.in_flight() == 2
    tracker.forget({TP})
    assert tracker.to_commit() == {other: Committed(10, "")}
    assert tracker.to_commit(only={TP}) == {}
