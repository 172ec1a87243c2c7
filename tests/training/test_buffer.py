"""The sample buffer: complete groups, no duplicates, stale groups evicted, bounded; a group's end
and failed rewards make a group that will not fill train partially or leave at once."""

from __future__ import annotations

from dataclasses import replace

from rollart.messages import Abort, GroupEnded, ScoredTrajectory
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


def ended(group: str, *members: int) -> GroupEnded:
    return GroupEnded(group_id=group, tag="t", completed=tuple(f"{group}-{i}" for i in members))


def reward_failed(group: str, i: int) -> Abort:
    return Abort(traj_id=f"{group}-{i}", turn=1, reason="reward_failed", group_id=group)


def test_a_group_that_ended_short_trains_partially_once_every_completed_member_is_in():
    buf = SampleBuffer(group_size=4, groups_per_batch=1, alpha=5, min_group_size=2)
    assert buf.end(ended("g", 0, 1, 2))  # its end can come before its members (another partition)
    buf.add(scored("g", 0, 0, reward=1.0))
    buf.add(scored("g", 1, 0, reward=0.0))
    assert buf.take_batch(0) is None, "member 2 completed and may still be scored"
    assert buf.member_failed(reward_failed("g", 2))
    batch = buf.take_batch(0)
    assert [sorted(g.members) for g in batch] == [["g-0", "g-1"]]
    assert sorted(batch[0].keys) == ["g#ended", "g-0", "g-1", "g-2#failed"], "its markers settle with it"
    assert buf.stats.partial_groups == 1
    assert not buf.end(ended("g", 0, 1, 2)) and not buf.member_failed(reward_failed("g", 2)), "late copies"
    assert not buf.add(scored("g", 3, 0)), "a late member of a trained group is not a new group"


def test_a_group_below_min_group_size_is_dropped_as_soon_as_it_ended():
    buf = SampleBuffer(group_size=4, groups_per_batch=1, alpha=5)  # min_group_size: the whole group
    buf.add(scored("short", 0, 0))
    buf.add(scored("short", 1, 0))
    buf.add(scored("full", 0, 0))
    assert buf.drop_unfillable() == [], "no end yet: the rest may come"
    buf.end(ended("short", 0, 1))  # two members faulted and their replacements ran out
    buf.end(ended("nothing"))  # every member faulted
    assert [g.group_id for g in buf.drop_unfillable()] == ["short", "nothing"]
    assert buf.stats.unfillable_groups == 2 and list(buf.groups) == ["full"]
    assert not buf.add(scored("short", 2, 0)) and not buf.end(ended("short", 0, 1)), "dropped stays dropped"


def test_a_redelivered_end_of_a_trained_group_is_recognised_by_its_trained_members():
    """After a trainer restart the buffer has forgotten its trained groups but not their trained ids."""
    buf = SampleBuffer(group_size=2, groups_per_batch=1, alpha=5)
    buf.trained.update({"g-0", "g-1"})  # restored from the checkpoint
    assert not buf.end(ended("g", 0, 1)) and len(buf) == 0


def test_a_revoked_marker_is_taken_back_and_counted_again_when_redelivered():
    buf = SampleBuffer(group_size=2, groups_per_batch=1, alpha=5, min_group_size=1)
    buf.add(scored("g", 0, 0))
    buf.end(ended("g", 0, 1))
    buf.member_failed(reward_failed("g", 1))
    buf.forget("g#ended")
    buf.forget("g-1#failed")
    assert buf.take_batch(0) is None, "without its end the group may still fill"
    assert buf.end(ended("g", 0, 1)) and buf.member_failed(reward_failed("g", 1))
    assert [sorted(g.members) for g in buf.take_batch(0)] == [["g-0"]]


def tagged(group: str, tag: str, version: int = 4) -> ScoredTrajectory:
    s = scored(group, 0, version)
    return replace(s, trajectory=replace(s.trajectory, tag=tag))


def test_batches_keep_the_task_mix_and_wait_a_while_for_a_slow_tag():
    """Two tags of equal weight, a fast one and a slow one: half of each batch is the slow tag's,
    the fast tag's surplus waits; past mix_wait_s with the slow tag short, the fast tag fills in."""
    buf = SampleBuffer(group_size=1, groups_per_batch=4, alpha=1, capacity=20, quotas={"fast": 2, "slow": 2},
                       mix_wait_s=10.0)
    for i in range(6):
        buf.add(tagged(f"f{i}", "fast"))
    buf.add(tagged("s0", "slow"))
    assert buf.take_batch(current_version=4, now=100.0) is None, "one slow group of two: wait"
    buf.add(tagged("s1", "slow"))
    batch = buf.take_batch(current_version=4, now=101.0)
    assert [g.group_id for g in batch] == ["f0", "f1", "s0", "s1"], "2 + 2, oldest first"
    assert [g.group_id for g in buf.groups.values()] == ["f2", "f3", "f4", "f5"], "the fast surplus waits"
    buf.add(tagged("s2", "slow"))
    assert buf.take_batch(current_version=4, now=200.0) is None
    assert buf.take_batch(current_version=4, now=209.0) is None, "still within mix_wait_s"
    batch = buf.take_batch(current_version=4, now=210.5)
    assert sorted(g.group_id for g in batch) == ["f2", "f3", "f4", "s2"] and buf.stats.mix_shortfall == 1


def test_the_tags_weights_give_each_tags_share_of_a_batch():
    from rollart.config import build_config

    def quotas(weights: dict, size: int, mix: str = "weights") -> dict:
        return build_config({"feeder": {"groups_per_batch": size}, "trainer": {"task_mix": mix},
                             "tags": {t: {"env": "frozenlake", "weight": w} for t, w in weights.items()}}).tag_quotas()

    assert quotas({"a": 1, "b": 1}, 4) == {"a": 2, "b": 2}
    assert quotas({"a": 2, "b": 1, "c": 1}, 8) == {"a": 4, "b": 2, "c": 2}
    assert quotas({"a": 1, "b": 1, "c": 1}, 4) in ({"a": 2, "b": 1, "c": 1}, {"a": 1, "b": 2, "c": 1},
                                                    {"a": 1, "b": 1, "c": 2})
    assert sum(quotas({"a": 3, "b": 0, "c": 1}, 5).values()) == 5 and "b" not in quotas({"a": 3, "b": 0}, 5)
    assert quotas({"a": 1, "b": 1}, 4, mix="arrival") == {}


def test_a_failed_member_with_a_replacement_holds_its_group_until_the_replacement_ends():
    buf = SampleBuffer(group_size=2, groups_per_batch=1, alpha=1, min_group_size=1)
    buf.add(scored("g", 0, 4))
    buf.end(ended("g", 0, 1))
    failed = replace(reward_failed("g", 1), replacement="g-1.d-0")
    assert buf.member_failed(failed) == "g-1#failed"
    assert buf.take_batch(current_version=4) is None, "not partial yet: a replacement is on its way"
    replaced = GroupEnded(group_id="g", tag="t", completed=("g-1.d-0",), replaces="g-1")
    assert buf.end(replaced) == "g-1#replaced" and buf.end(replaced) is None, "a second copy"
    assert buf.take_batch(current_version=4) is None, "its completed rollout is still being scored"
    buf.add(scored("g", "1.d-0", 4))
    batch = buf.take_batch(current_version=4)
    assert [sorted(g.members) for g in batch] == [["g-0", "g-1.d-0"]] and buf.stats.partial_groups == 0


def test_a_replacement_that_completed_nothing_lets_its_group_train_partially():
    buf = SampleBuffer(group_size=2, groups_per_batch=1, alpha=1, min_group_size=1)
    buf.add(scored("g", 0, 4))
    buf.end(GroupEnded(group_id="g", tag="t", completed=(), replaces="g-1"))  # it can come first
    buf.member_failed(replace(reward_failed("g", 1), replacement="g-1.d-0"))
    assert buf.take_batch(current_version=4) is None, "the group's own end has not come"
    buf.end(ended("g", 0, 1))
    assert [list(g.members) for g in buf.take_batch(current_version=4)] == [["g-0"]] and buf.stats.partial_groups == 1
    buf2 = SampleBuffer(group_size=2, groups_per_batch=1, alpha=1, min_group_size=1)
    buf2.add(scored("h", 0, 4))
    buf2.end(ended("h", 0, 1))
    key = buf2.member_failed(replace(reward_failed("h", 1), replacement="h-1.d-0"))
    buf2.forget(key)  # its handler was cancelled: it will come again
    assert buf2.groups["h"].replacing == set() and buf2.groups["h"].failed == set()


def test_a_batch_built_in_parts_takes_ready_groups_then_the_rest_and_counts_once():
    """take_ready hands out complete groups the batch will hold whatever arrives later (the oldest, up to
    its size); take_batch then returns only the rest. Stale groups are evicted first either way."""
    buf = SampleBuffer(group_size=2, groups_per_batch=3, alpha=1, capacity=10)
    for i in range(2):
        buf.add(scored("old", i, 2))
    buf.add(scored("g1", 0, 4))
    for i in range(2):
        buf.add(scored("g2", i, 4))
    taken = buf.take_ready(current_version=4, taken=[])
    assert [g.group_id for g in taken] == ["g2"], "the only complete fresh group; 'old' is evicted"
    assert buf.stats.evicted_stale_groups == 1
    assert buf.take_batch(current_version=4, taken=taken) is None, "one of three: not yet"
    assert not buf.add(scored("g2", 0, 4)), "a taken group's members count as trained"
    buf.add(scored("g1", 1, 4))
    taken += buf.take_ready(current_version=4, taken=taken)
    assert [g.group_id for g in taken] == ["g2", "g1"]
    for i in range(2):
        buf.add(scored("g3", i, 4))
        buf.add(scored("g4", i, 4))
    rest = buf.take_batch(current_version=4, taken=taken)
    assert [g.group_id for g in rest] == ["g3"], "the rest of the batch: one group"
    assert [g.group_id for g in buf.groups.values()] == ["g4"] and buf.stats.batches == 1


def test_a_batch_built_in_parts_keeps_the_task_mix():
    """Ready groups are taken only within their tag's quota; a short tag is filled by others only when
    the batch is formed, after the mix's wait."""
    buf = SampleBuffer(group_size=1, groups_per_batch=4, alpha=1, capacity=20, quotas={"fast": 2, "slow": 2},
                       mix_wait_s=10.0)
    for i in range(4):
        buf.add(tagged(f"f{i}", "fast"))
    taken = buf.take_ready(current_version=4, taken=[])
    assert [g.group_id for g in taken] == ["f0", "f1"], "the fast tag's quota, no more"
    assert buf.take_ready(current_version=4, taken=taken) == []
    buf.add(tagged("s0", "slow"))
    taken += buf.take_ready(current_version=4, taken=taken)
    assert [g.group_id for g in taken] == ["f0", "f1", "s0"]
    assert buf.take_batch(current_version=4, taken=taken, now=100.0) is None, "the slow tag is one short: wait"
    rest = buf.take_batch(current_version=4, taken=taken, now=110.5)
    assert [g.group_id for g in rest] == ["f2"] and buf.stats.mix_shortfall == 1
