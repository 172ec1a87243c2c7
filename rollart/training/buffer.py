"""The trainer's sample buffer: scored trajectories grouped by task group, bounded, stale-evicting.

* A group is complete when ``group_size`` distinct trajectories arrived; extra copies of a trajectory
  (a rerun after a crash) and extra members of a full group are dropped, and a trajectory id that was
  ever trained is never accepted again.
* Before a batch is formed, groups whose oldest token is too stale (``current - start_version >
  alpha``) are evicted and counted; with alpha = 0 only samples of the current policy are trained.
* A group's end (GroupEnded: the members that completed) and the members whose reward failed tell
  when a group will not fill (a failed member whose Abort names a replacement is waited for until
  its replacement task's own GroupEnded, ``replaces``, says what that completed): it then trains
  with the members it has if there are at least ``min_group_size`` (a partial group, advantages over
  those present) or is dropped at once, instead of waiting until the buffer overflows. These markers
  are held like samples (keys ``<group>#ended``, ``<traj>#failed``, ``<traj>#replaced``) and settled
  with their group.
* The task mix: with ``quotas`` (each tag's groups per batch, from the tags' weights) a batch takes
  the oldest trainable groups of each tag up to its quota; a tag short of groups is waited for up to
  ``mix_wait_s`` (from when a batch could first have formed), then other tags' oldest groups fill its
  places (counted: ``mix_shortfall``). A fast tag's surplus stays buffered for later batches (and is
  evicted if it goes stale). Without quotas a batch is the oldest trainable groups.
* Memory is bounded: at most ``capacity`` groups are held; :meth:`full` tells the consumer to pause
  (backpressure) instead of growing without limit when the trainer is slower than rollout. With the
  feeder's admission bound, ``(alpha + 1) * groups_per_batch`` groups are the most that can be useful.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from rollart.messages import Abort, GroupEnded, ScoredTrajectory

# marker keys: <group id>#ended, <traj id>#failed, <traj id>#replaced (its replacement task's end)
ENDED, FAILED, REPLACED = "#ended", "#failed", "#replaced"


@dataclass
class Group:
    group_id: str
    tag: str | None = None
    members: dict[str, ScoredTrajectory] = field(default_factory=dict)
    expected: frozenset[str] | None = None  # the members that completed, once the group ended
    failed: set[str] = field(default_factory=set)  # completed members whose reward failed
    replacing: set[str] = field(default_factory=set)  # failed members with a replacement task released
    replaced: dict[str, frozenset[str]] = field(default_factory=dict)  # failed member -> what its task completed
    markers: list[str] = field(default_factory=list)  # keys of the markers held with the group

    @property
    def start_version(self) -> int:
        return min(s.trajectory.start_version for s in self.members.values())

    @property
    def keys(self) -> list[str]:
        """Everything held for the group: its samples' trajectory ids, then its markers' keys."""
        return [*self.members, *self.markers]

    def final(self) -> bool:
        """No more members will come: every replacement task ended, and every member that completed
        (in the group's own task or a replacement's) is here or failed."""
        if self.expected is None or not self.replacing <= self.replaced.keys():
            return False
        expected = self.expected.union(*self.replaced.values())
        return expected <= self.members.keys() | self.failed


@dataclass
class BufferStats:
    added: int = 0
    duplicates: int = 0
    overflow: int = 0  # members beyond group_size
    evicted_stale_groups: int = 0
    evicted_full_groups: int = 0  # incomplete groups dropped to make room
    uninformative_groups: int = 0  # dynamic sampling: all rewards equal
    late_members: int = 0  # arrived after their group was dropped (stale or incomplete): dropped too
    partial_groups: int = 0  # trained with fewer than group_size members (min_group_size)
    unfillable_groups: int = 0  # ended with fewer than min_group_size scored: dropped at once
    mix_shortfall: int = 0  # batch places of a tag short of groups, filled by other tags after mix_wait_s
    batches: int = 0


class SampleBuffer:
    def __init__(self, *, group_size: int, groups_per_batch: int, alpha: int, capacity: int | None = None,
                 drop_uninformative: bool = False, min_group_size: int | None = None,
                 quotas: dict[str, int] | None = None, mix_wait_s: float = 0.0):
        self.drop_uninformative = drop_uninformative
        self.quotas = {tag: n for tag, n in (quotas or {}).items() if n > 0}
        self.mix_wait_s = mix_wait_s
        self._short_since: float | None = None  # a batch could have formed but for the mix, since
        self.group_size = group_size
        self.min_group_size = min_group_size or group_size
        self.groups_per_batch = groups_per_batch
        self.alpha = alpha
        self.capacity = capacity or (alpha + 2) * groups_per_batch
        self.groups: OrderedDict[str, Group] = OrderedDict()
        self.trained: set[str] = set()
        # Groups dropped stale or incomplete: a member arriving later is dropped with them, not made a
        # new group that is dropped (and its admission place given back) a second time.
        self.dropped: set[str] = set()
        self.trained_groups: set[str] = set()  # a marker or member arriving later is not a new group
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
        if traj.group_id in self.dropped or traj.group_id in self.trained_groups:
            self.stats.late_members += 1
            return False
        group = self._group(traj.group_id, traj.tag)
        if len(group.members) >= self.group_size:
            self.stats.overflow += 1
            return False
        group.members[traj.traj_id] = scored
        self.stats.added += 1
        return True

    def _group(self, group_id: str, tag: str | None) -> Group:
        group = self.groups.get(group_id)
        if group is None:
            group = self.groups[group_id] = Group(group_id)
        group.tag = group.tag or tag
        return group

    def _closed(self, group_id: str, traj_ids) -> bool:
        """The group was trained or dropped already (a marker's redelivered or late copy)."""
        return group_id in self.dropped or group_id in self.trained_groups or any(t in self.trained for t in traj_ids)

    def end(self, ended: GroupEnded) -> str | None:
        """Take a group's end, or a replacement task's; returns the marker's key, or None if the group is
        over already or this end was taken (settle it now)."""
        if ended.replaces:
            return self._replacement_ended(ended)
        group = self.groups.get(ended.group_id)
        if self._closed(ended.group_id, ended.completed) or (group is not None and group.expected is not None):
            return None
        group = self._group(ended.group_id, ended.tag)
        group.expected = frozenset(ended.completed)
        group.markers.append(ended.group_id + ENDED)
        return ended.group_id + ENDED

    def _replacement_ended(self, ended: GroupEnded) -> str | None:
        group = self.groups.get(ended.group_id)
        if self._closed(ended.group_id, ended.completed) or (group is not None and ended.replaces in group.replaced):
            return None
        group = self._group(ended.group_id, ended.tag)
        group.replaced[ended.replaces] = frozenset(ended.completed)
        group.markers.append(ended.replaces + REPLACED)
        return ended.replaces + REPLACED

    def member_failed(self, aborted: Abort) -> str | None:
        """A completed member whose reward failed will not come (a replacement task may, if the Abort
        names one); returns the marker's key, or None if already known or too late."""
        group = self.groups.get(aborted.group_id)
        if self._closed(aborted.group_id, ()) or (group is not None and aborted.traj_id in group.failed):
            return None
        group = self._group(aborted.group_id, aborted.tag)
        group.failed.add(aborted.traj_id)
        if aborted.replacement:
            group.replacing.add(aborted.traj_id)
        group.markers.append(aborted.traj_id + FAILED)
        return aborted.traj_id + FAILED

    def forget(self, key: str) -> None:
        """Take back a sample or marker that was never settled (its handler was cancelled): it will come again."""
        for group in self.groups.values():
            if group.members.pop(key, None) is None and key not in group.markers:
                continue
            if key in group.markers:
                group.markers.remove(key)
                if key.endswith(ENDED):
                    group.expected = None
                elif key.endswith(REPLACED):
                    group.replaced.pop(key[: -len(REPLACED)], None)
                else:
                    group.failed.discard(key[: -len(FAILED)])
                    group.replacing.discard(key[: -len(FAILED)])
            if not group.keys:
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
        aborted, and no GroupEnded said so): without this, no batch forms, the version never advances
        and nothing goes stale."""
        for group in self.groups.values():
            if not self.trainable(group):
                del self.groups[group.group_id]
                self.dropped.add(group.group_id)
                self.stats.evicted_full_groups += 1
                return group
        return None

    def drop_unfillable(self) -> list[Group]:
        """Remove groups that ended with fewer than ``min_group_size`` scored members: nothing will fill them."""
        unfillable = [g for g in self.groups.values() if g.final() and len(g.members) < self.min_group_size]
        for group in unfillable:
            del self.groups[group.group_id]
            self.dropped.add(group.group_id)
        self.stats.unfillable_groups += len(unfillable)
        return unfillable

    def drop_uninformative_groups(self) -> list[Group]:
        """Dynamic sampling: remove trainable groups whose rewards are all equal (no GRPO signal)."""
        if not self.drop_uninformative:
            return []
        dropped = [g for g in self.complete_groups() if len({round(s.reward, 9) for s in g.members.values()}) == 1]
        for group in dropped:
            del self.groups[group.group_id]
            self.trained.update(group.members)  # consumed: a redelivered copy must not form a new group
            self.trained_groups.add(group.group_id)
        self.stats.uninformative_groups += len(dropped)
        return dropped

    def trainable(self, group: Group) -> bool:
        """Full, or ended with at least ``min_group_size`` scored members (a partial group)."""
        return len(group.members) >= self.group_size or (group.final() and len(group.members) >= self.min_group_size)

    def complete_groups(self) -> list[Group]:
        """The groups a batch can take: full ones and trainable partial ones, oldest first."""
        return [g for g in self.groups.values() if self.trainable(g)]

    def take_batch(self, current_version: int, now: float | None = None, *,
                   taken: Sequence[Group] = ()) -> list[Group] | None:
        """``groups_per_batch`` trainable, fresh groups (the oldest, in the task mix's shares), or None
        if there are not enough yet. Stale groups are evicted first (a caller that must know which
        calls :meth:`evict_stale` itself). ``now``: monotonic seconds (the mix's wait). ``taken``: the
        batch's groups already taken by :meth:`take_ready` (a step built in parts): only the rest is
        returned, and the batch counted once."""
        self.evict_stale(current_version)
        complete = self.complete_groups()
        if len(complete) < self.groups_per_batch - len(taken):
            self._short_since = None
            return None
        batch = self._mixed(complete, time.monotonic() if now is None else now, taken)
        if batch is None:
            return None
        self._take(batch)
        self.stats.batches += 1
        return batch

    def take_ready(self, current_version: int, taken: Sequence[Group]) -> list[Group]:
        """Trainable groups that the batch being built from ``taken`` will hold whatever else arrives:
        the oldest, up to its size and each tag's quota (a tag short of groups is filled by others only
        at :meth:`take_batch`, after the mix's wait)."""
        self.evict_stale(current_version)
        ready = self._within_quotas(self.complete_groups(), taken)
        self._take(ready)
        return ready

    def _take(self, groups: list[Group]) -> None:
        for group in groups:
            del self.groups[group.group_id]
            self.trained.update(group.members)
            self.trained_groups.add(group.group_id)
            self.stats.partial_groups += len(group.members) < self.group_size

    def _quotas_left(self, taken: Sequence[Group]) -> dict[str | None, int] | None:
        if not self.quotas:
            return None
        left: dict[str | None, int] = dict(self.quotas)
        for group in taken:
            if left.get(group.tag, 0) > 0:
                left[group.tag] -= 1
        return left

    def _within_quotas(self, complete: list[Group], taken: Sequence[Group]) -> list[Group]:
        """The oldest of ``complete`` that fit beside ``taken``: up to the batch's size and each tag's
        quota left, oldest first."""
        room = self.groups_per_batch - len(taken)
        left = self._quotas_left(taken)
        if left is None:
            return complete[:room]
        chosen = {id(g) for tag, quota in left.items() for g in [g for g in complete if g.tag == tag][:quota]}
        return [g for g in complete if id(g) in chosen]

    def _mixed(self, complete: list[Group], now: float, taken: Sequence[Group] = ()) -> list[Group] | None:
        """The rest of the batch from ``complete`` (oldest first) under the quotas, beside ``taken``;
        None while waiting for a short tag."""
        picked = self._within_quotas(complete, taken)
        short = self.groups_per_batch - len(taken) - len(picked)
        if self.quotas and short > 0:
            if self._short_since is None:
                self._short_since = now
            if now - self._short_since < self.mix_wait_s:
                return None
            chosen = {id(g) for g in picked}
            picked += [g for g in complete if id(g) not in chosen][:short]
            self.stats.mix_shortfall += short
        self._short_since = None
        order = {id(g): i for i, g in enumerate(complete)}
        return sorted(picked, key=lambda g: order[id(g)])
