"""The sample buffer: complete groups, no duplicates, stale groups evicted, bounded."""

from __future__ import annotations

from dataclasses import replace

from rollart.messages import ScoredTrajectory
from rollart.messages.samples import sample_trajectory
from rollart.training.buffer import SampleBuffer


def scored(group: str, i: int, version: int, reward: float = 1.0) -> ScoredTrajectory:
    t = replace(sample_trajectory(f"{group}-{i}", version=version), group_id=group)
    return ScoredTrajectory(trajectory=t, reward=reward)


def test_batches_hold_complete_fresh_groups_and_never_a_trained_trajectory():
    buf = SampleBuffer(group_size=2, groups_per_batch=2, alpha=1)
    for group, version in (("g1", 3), ("g2", 4), ("g3", 4)):
        for i in range(2):
            assert buf.add(scored(group, i, version))
    assert not buf.add(scored("g1", 0, 3)), "a second copy of a trajectory"
    assert not buf.add(scored("g1", 5, 3)), "a third member of a full group of two"
    batch = buf.take_batch(current_version=5)  # g1 (version 3) is 2 > alpha behind: evicted
    assert [g.group_id for g in batch] == ["g2", "g3"]
    assert buf.stats.evicted_stale_groups == 1 and len(buf) == 0
    assert not buf.add(scored("g2", 0, 4)), "trained trajectories are never accepted again"
    assert (buf.stats.duplicates, buf.stats.overflow) == (2, 1)


def test_alpha_zero_trains_only_the_current_policy():
    buf = SampleBuffer(group_size=1, groups_per_batch=1, alpha=0)
    buf.add(scored("old", 0, 6))
    buf.add(scored("new", 0, 7))
    batch = buf.take_batch(current_version=7)
    assert [g.group_id for g in batch] == ["new"] and buf.stats.evicted_stale_groups == 1


def test_buffer_reports_full_for_backpressure():
    buf = SampleBuffer(group_size=4, groups_per_batch=2, alpha=1)
    assert buf.capacity == 6
    for g in range(6):
        buf.add(scored(f"g{g}", 0, 0))
    assert buf.full() and buf.take_batch(0) is None, "incomplete groups never form a batch"


def test_dynamic_sampling_drops_groups_whose_rewards_are_all_equal():
    buf = SampleBuffer(group_size=2, groups_per_batch=1, alpha=5, drop_uninformative=True)
    for i in range(2):
        buf.add(scored("flat", i, 0, reward=0.0))
        buf.add(scored("mixed", i, 0, reward=float(i)))
    dropped = buf.drop_uninformative_groups()
    assert [g.group_id for g in dropped] == ["flat"] and buf.stats.uninformative_groups == 1
    assert not buf.add(scored("flat", 0, 0, reward=0.0)), "a dropped trajectory redelivered is not taken again"
    assert [g.group_id for g in buf.take_batch(0)] == ["mixed"]


def test_a_full_buffer_of_incomplete_groups_makes_room():
    buf = SampleBuffer(group_size=3, groups_per_batch=1, alpha=5, capacity=2)
    buf.add(scored("a", 0, 0))
    buf.add(scored("b", 0, 0))
    assert buf.full() and buf.take_batch(0) is None
    assert buf.evict_oldest_incomplete().group_id == "a" and buf.stats.evicted_full_groups == 1
    assert not buf.full()


def test_a_late_member_of_a_dropped_group_is_dropped_with_it_not_evicted_again():
    """Regression (a loaded CI machine): members of a stale group arriving one by one made the group
    anew after its eviction, and it was evicted (its admission place given back) a second time."""
    buf = SampleBuffer(group_size=2, groups_per_batch=1, alpha=1)
    assert buf.add(scored("old", 0, 0))
    assert [g.group_id for g in buf.evict_stale(current_version=2)] == ["old"]
    assert not buf.add(scored("old", 1, 0)), "the second member, after its group was evicted"
    assert buf.evict_stale(current_version=2) == [] and len(buf) == 0
    assert (buf.stats.evicted_stale_groups, buf.stats.late_members) == (1, 1)
