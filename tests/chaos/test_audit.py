"""The chaos audit's bookkeeping on hand-built topic contents (the campaign test runs it on real ones)."""

from __future__ import annotations

from collections import namedtuple

from rollart.chaos.audit import Audit, _audit_rewards, _audit_trajectories, _extra_copies
from rollart.messages import Abort, TaskSpec
from rollart.messages.samples import sample_trajectory

Record = namedtuple("Record", "topic partition offset")
TOPIC = "job.trajectories.completed"


def completed(*rows):
    return [(Record(TOPIC, 0, offset), sample_trajectory(traj_id)) for traj_id, offset in rows]


def test_a_twice_produced_completion_is_accounted_for_by_its_first_copys_dead_letter():
    # g1-0 completed twice (its env member died after producing); the first copy was dead-lettered,
    # the second de-duplicated by the reward group: accounted for, not unscored.
    records = completed(("g1-0", 0), ("g1-1", 1), ("g1-0", 2))
    audit = Audit()
    _audit_rewards(audit, records, scored={"g1-1"}, dead={(TOPIC, 0, 0)}, reward_committed={0: 3})
    assert audit.unscored == [] and audit.reward_dead_lettered == 1 and audit.scored == 1


def test_a_committed_completion_neither_scored_nor_dead_lettered_is_reported():
    records = completed(("g1-0", 0), ("g1-1", 1), ("g1-2", 2))
    audit = Audit()
    _audit_rewards(audit, records, scored={"g1-0"}, dead=set(), reward_committed={0: 2})
    assert audit.unscored == ["g1-1"]  # g1-2 is past the committed offset: still in flight, not lost
    assert not audit.holds


def test_a_settled_group_needs_every_member_ended_and_an_unsettled_one_is_in_flight():
    tasks = [(Record("job.tasks", 0, 0), TaskSpec(group_id="g1", env="frozenlake", tag="t", group_size=2, seed=1,
                                                  redundancy=1)),
             (Record("job.tasks", 0, 1), TaskSpec(group_id="g2", env="frozenlake", tag="t", group_size=2, seed=2))]
    ends = completed(("g1-0", 0), ("g1-1", 1)) + [(Record(TOPIC, 0, 2), Abort(traj_id="g1-1", turn=1,
                                                                               reason="redundant"))]
    audit = Audit()
    _audit_trajectories(audit, tasks, ends, task_committed={0: 1})
    assert audit.groups_released == 2 and audit.groups_settled == 1
    assert audit.trajectories_lost == ["g1-2"]  # the redundant third member never ended
    assert audit.trajectories_completed == 2 and audit.trajectories_aborted == {}


def test_a_replacement_rollout_must_end_too():
    tasks = [(Record("job.tasks", 0, 0), TaskSpec(group_id="g1", env="frozenlake", tag="t", group_size=2, seed=1))]
    failed = [(Record(TOPIC, 0, 0), Abort(traj_id="g1-0", turn=1, reason="env_step_failed", group_id="g1",
                                          replacement="g1-r0"))]
    audit = Audit()
    _audit_trajectories(audit, tasks, failed + completed(("g1-1", 1)), task_committed={0: 1})
    assert audit.trajectories_lost == ["g1-r0"] and audit.replacements == 1
    audit = Audit()
    _audit_trajectories(audit, tasks, failed + completed(("g1-1", 1), ("g1-r0", 2)), task_committed={0: 1})
    assert audit.trajectories_lost == [] and audit.trajectories_aborted == {"env_step_failed": 1}


def test_copies_of_a_message_id_count_as_duplicates_produced():
    # g1-0 produced three times (two redeliveries after kills); an Abort of g1-1 is another message
    records = completed(("g1-0", 0), ("g1-1", 1), ("g1-0", 2), ("g1-0", 3))
    records.append((Record(TOPIC, 0, 4), Abort(traj_id="g1-1", turn=1, reason="redundant")))
    assert _extra_copies(records) == (2, ["traj:g1-0 @0:0,0:2,0:3"])  # where the copies lie, to debug them
    assert _extra_copies(completed(("g1-0", 0), ("g1-1", 1))) == (0, [])


def test_the_longest_stall_counts_from_the_last_step_to_the_end_and_fails_the_audit():
    from rollart.chaos.audit import longest_stall

    record = [{"step": 1, "time": 100.0}, {"event": "publish", "time": 101.0}, {"step": 2, "time": 110.0},
              {"step": 3, "time": 115.0}]
    assert longest_stall(record, ended_at=None) == 10.0
    assert longest_stall(record, ended_at=415.0) == 300.0, "trained nothing after step 3"
    assert not Audit(longest_stall_s=300.0, stall_limit_s=300.0).stalled
    stalled = Audit(longest_stall_s=300.5, stall_limit_s=300.0)
    assert stalled.stalled and not stalled.holds and stalled.as_dict()["stalled"]


def test_trained_per_minute_leaves_out_the_start_up():
    from rollart.chaos.run import trained_per_minute

    record = [{"step": 1, "time": 1000.0, "samples": 16}, {"event": "publish", "time": 1001.0},
              {"step": 2, "time": 1030.0, "samples": 16}, {"step": 3, "time": 1060.0, "samples": 14}]
    assert trained_per_minute(record) == 30.0, "(16 + 14) trajectories in the minute after the first step"
    assert trained_per_minute(record[:1]) is None


def test_a_dead_lettered_members_replacement_task_must_end_and_is_not_a_group():
    tasks = [(Record("job.tasks", 0, 0), TaskSpec(group_id="g1", env="frozenlake", tag="t", group_size=2, seed=1)),
             (Record("job.tasks", 0, 1), TaskSpec(group_id="g1", env="frozenlake", tag="t", group_size=1, seed=1,
                                                  replaces="g1-0"))]
    audit = Audit()
    _audit_trajectories(audit, tasks, completed(("g1-0", 0), ("g1-1", 1)), task_committed={0: 2})
    assert audit.trajectories_lost == ["g1-0.d-0"] and audit.reward_replacements == 1
    assert (audit.groups_released, audit.groups_settled) == (1, 1)
    audit = Audit()
    _audit_trajectories(audit, tasks, completed(("g1-0", 0), ("g1-1", 1), ("g1-0.d-0", 2)), task_committed={0: 2})
    assert audit.trajectories_lost == []
