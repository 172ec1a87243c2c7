"""The trainer's sample buffer: scored trajectories grouped by task group, bounded, stale-evicting.

* A group is complete when ``group_size`` distinct trajectories arrived; extra copies of a trajectory
  (a rerun after a crash) and extra members of a full group are dropped, and a trajectory id that was
  ever trained is never accepted again.
* Before a batch is formed, groups whose oldest token is too stale (``current - start_version >
  alpha``) are evicted and counted; with alpha = 0 only samples of the current policy are trained.
* Memory is bounded: at most ``capacity`` groups are held; :meth:`full` tells the consumer to pause
  (backpressure) instead of growing without limit when the trainer is slower than rollout. With the
  feeder's admission bound, ``(alpha + 1) * groups_per_batch`` groups are the most that can be useful.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from rollart.messages import ScoredTrajectory


@dataclass
class Group:
    group_id: str
    members: dict[str, ScoredTrajectory] = field(default_factory=dict)

    @property
    def start_version(self) -> int:
        return min(s.trajectory.start_version for s in self.members.values())


@dataclass
class BufferStats:
    added: int = 0
    duplicates: int = 0
    overflow: int = 0  # members beyond group_size
    evicted_stale_groups: int = 0
    evicted_full_groups: int = 0  # incomplete groups dropped to make room
    uninformative_groups: int = 0  # dynamic sampling: all rewards equal
    late_members: int = 0  # arrived after their group was dropped (stale or incomplete): dropped too
    batches: int = 0


class SampleBuffer:
    def __init__(self, *, group_size: int, groups_per_batch: int, alpha: int, capacity: int | None = None,
                 drop_uninformative: bool = False):
        self.drop_uninformative = drop_uninformative
        self.group_size = group_size
        self.groups_per_batch = groups_per_batch
        self.alpha = alpha
        self.capacity = capacity or (alpha + 2) * groups_per_batch
        self.groups: OrderedDict[str, Group] = OrderedDict()
        self.trained: set[str] = set()
        # Groups dropped stale or incomplete: a member arriving later is dropped with them, not made a
        # new group that is dropped (and its admission place given back) a second time.
        self.dropped: set[str] = set()
        self.stats = BufferStats()

    def __len__(self) -> int:
        return len(self.groups)

    def full(self) -> bool:
        return len(self.groups) >= self.capacity

    def add(self, scored: ScoredTrajectory) -> bool:
        """Take a scored trajectory; False if it is a duplicate or its group is already full."""
        traj = scored.trajectory
        group = self.groups.get(traj.group_id)
        if traj.traj_id in self.trained or (group is not None and traj.traj_id in group.members):
            self.stats.duplicates += 1
            return False
        if traj.group_id in self.dropped:
            self.stats.late_members += 1
            return False
        if group is None:
            group = self.groups[traj.group_id] = Group(traj.group_id)
        if len(group.members) >= self.group_size:
            self.stats.overflow += 1
            return False
        group.members[traj.traj_id] = scored
        self.stats.added += 1
        return True

    def forget(self, traj_id: str) -> None:
        """Take back a sample that was never settled (its handler was cancelled): it will come again."""
        for group in self.groups.values():
            if group.members.pop(traj_id, None) is not None:
                if not group.members:
                    del self.groups[group.group_id]
                return

    def evict_stale(self, current_version: int) -> list[Group]:
        stale = [g for g in self.groups.values() if g.members and current_version - g.start_version > self.alpha]
        for group in stale:
            del self.groups[group.group_id]
            self.dropped.add(group.group_id)
        self.stats.evicted_stale_groups += len(stale)
        return stale

    def evict_oldest_incomplete(self) -> Group | None:
        """Make room when the buffer is full of groups that cannot complete (their other members were
        aborted): without this, no batch forms, the version never advances and nothing goes stale."""
        for group in self.groups.values():
            if len(group.members) < self.group_size:
                del self.groups[group.group_id]
                self.dropped.add(group.group_id)
                self.stats.evicted_full_groups += 1
                return group
        return None

    def drop_uninformative_groups(self) -> list[Group]:
        """Dynamic sampling: remove complete groups whose rewards are all equal (no GRPO signal)."""
        if not self.drop_uninformative:
            return []
        dropped = [g for g in self.complete_groups() if len({round(s.reward, 9) for s in g.members.values()}) == 1]
        for group in dropped:
            del self.groups[group.group_id]
            self.trained.update(group.members)  # consumed: a redelivered copy must not form a new group
        self.stats.uninformative_groups += len(dropped)
        return dropped

    def complete_groups(self) -> list[Group]:
        return [g for g in self.groups.values() if len(g.members) >= self.group_size]

    def take_batch(self, current_version: int) -> list[Group] | None:
        """The oldest ``groups_per_batch`` complete, fresh groups, or None if there are not enough yet.
        Stale groups are evicted first (a caller that must know which calls :meth:`evict_stale` itself)."""
        self.evict_stale(current_version)
        complete = self.complete_groups()
        if len(complete) < self.groups_per_batch:
            return None
        batch = complete[: self.groups_per_batch]
        for group in batch:
            del self.groups[group.group_id]
            self.trained.update(group.members)
        self.stats.batches += 1
        return batch
