"""After a chaos run: is every task, trajectory and bad record accounted for?

Read from the topics and the trainer's record, never from Redis (it may have been flushed):

* every trajectory of every group whose task the env group committed (its members and the
  replacements started for faulted ones) either completed or was aborted with a reason (``lost``
  otherwise); a group whose task is not committed was in flight when
  the run stopped and would be rerun — not lost;
* every completed trajectory the reward group committed past was scored or dead-lettered;
* no trajectory was trained twice, none beyond the staleness bound;
* every injected bad record is in its topic's DLQ (matched by source topic, partition and offset);
* no stall: the longest time without a training step stays under the stall limit;
* ``duplicates_produced``: per topic, records whose message id an earlier record already carried
  (a stage killed after producing, before committing, produces again on redelivery). Under
  at-least-once they are expected, and de-duplicated by id downstream (nothing is trained twice).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rollart.bus.dlq import H_DLQ_OFFSET, H_DLQ_PARTITION, H_DLQ_TOPIC
from rollart.bus.reader import read_to_end
from rollart.chaos.inject import Injected
from rollart.config import RollartConfig
from rollart.endpoints import Endpoints
from rollart.lag import consumer_lag
from rollart.messages import Abort, CompletedTrajectory, MessageDecodeError, ScoredTrajectory, TaskSpec
from rollart.replay import ReplayFilter, replay
from rollart.topics import expand_catalog
from rollart.names import REWARDS_RESULTS, TASKS, TRAJECTORIES_COMPLETED


@dataclass
class Audit:
    groups_released: int = 0
    groups_settled: int = 0  # task committed by the env group
    trajectories_completed: int = 0
    trajectories_aborted: dict[str, int] = field(default_factory=dict)  # by reason
    trajectories_lost: list[str] = field(default_factory=list)
    replacements: int = 0  # replacement rollouts started for members ended by a fault
    reward_replacements: int = 0  # replacement tasks released for dead-lettered members
    unscored: list[str] = field(default_factory=list)  # completed, committed by reward, neither scored nor DLQ'd
    scored: int = 0
    reward_dead_lettered: int = 0
    trained: int = 0
    duplicates_trained: list[str] = field(default_factory=list)
    staleness_max: int = 0
    over_staleness: int = 0
    bad_injected: int = 0
    bad_not_in_dlq: list[str] = field(default_factory=list)
    duplicates_produced: dict[str, int] = field(default_factory=dict)  # logical topic -> extra copies
    # logical topic -> a few duplicated records, "<message id> @<partition>:<offset>,...", to debug them
    duplicate_examples: dict[str, list[str]] = field(default_factory=dict)
    longest_stall_s: float = 0.0  # the longest time without a training step, from the first one to the end
    stall_limit_s: float | None = None

    @property
    def stalled(self) -> bool:
        return self.stall_limit_s is not None and self.longest_stall_s > self.stall_limit_s

    @property
    def holds(self) -> bool:
        return not (self.trajectories_lost or self.unscored or self.duplicates_trained or self.over_staleness
                    or self.bad_not_in_dlq or self.stalled)

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "stalled": self.stalled, "holds": self.holds}


async def _messages(config: RollartConfig, endpoints: Endpoints, topic: str) -> list[tuple[Any, Any]]:
    return [(r, m) async for r, m in replay(config, endpoints, topic, ReplayFilter())
            if not isinstance(m, MessageDecodeError)]


async def _dlq_sources(config: RollartConfig, endpoints: Endpoints) -> set[tuple[str, int, int]]:
    sources = set()
    for topic in expand_catalog(config):
        if not topic.is_dlq:
            continue
        async for record in read_to_end(config, endpoints, topic.name):
            headers = dict(record.headers or ())
            if H_DLQ_TOPIC in headers:
                sources.add((headers[H_DLQ_TOPIC].decode(), int(headers[H_DLQ_PARTITION]), int(headers[H_DLQ_OFFSET])))
    return sources


def _committed(rows, group: str, topic: str) -> dict[int, int]:
    return {r.partition: r.committed or 0 for r in rows if r.group == group and r.topic == topic}


async def audit_run(config: RollartConfig, endpoints: Endpoints, record: list[dict], alpha: int | None,
                    injected: list[Injected], *, stall_limit_s: float | None = None,
                    ended_at: float | None = None) -> Audit:
    audit = Audit(stall_limit_s=stall_limit_s)
    lag = await consumer_lag(config, endpoints)
    tasks = await _messages(config, endpoints, TASKS)
    completions = await _messages(config, endpoints, TRAJECTORIES_COMPLETED)
    results = await _messages(config, endpoints, REWARDS_RESULTS)
    for topic, messages in ((TASKS, tasks), (TRAJECTORIES_COMPLETED, completions), (REWARDS_RESULTS, results)):
        audit.duplicates_produced[topic], audit.duplicate_examples[topic] = _extra_copies(messages)
    # a trajectory its env member scored (scored_by: env) ended on rewards.results, not on trajectories.completed
    ended = completions + [(r, m.trajectory) for r, m in results if isinstance(m, ScoredTrajectory)]
    _audit_trajectories(audit, tasks, ended, _committed(lag, "env", TASKS))
    scored = {m.trajectory.traj_id for _, m in results if isinstance(m, ScoredTrajectory)}
    dead = await _dlq_sources(config, endpoints)
    completed = [(r, m) for r, m in completions if isinstance(m, CompletedTrajectory)]
    _audit_rewards(audit, completed, scored, dead, _committed(lag, "reward", TRAJECTORIES_COMPLETED))
    _audit_training(audit, record, alpha)
    audit.longest_stall_s = longest_stall(record, ended_at)
    audit.bad_injected = len(injected)
    audit.bad_not_in_dlq = [f"{i.topic}[{i.partition}]@{i.offset} ({i.what})" for i in injected
                            if (i.topic, i.partition, i.offset) not in dead]
    return audit


def _extra_copies(messages, examples: int = 8) -> tuple[int, list[str]]:
    """Records beyond the first of each message id, and where the first few duplicated ids lie."""
    where: dict[str, list[str]] = {}
    for record, message in messages:
        where.setdefault(message.message_id(), []).append(f"{record.partition}:{record.offset}")
    copied = {mid: at for mid, at in where.items() if len(at) > 1}
    return sum(len(at) - 1 for at in copied.values()), [f"{mid} @{','.join(at)}" for mid, at in
                                                          list(copied.items())[:examples]]


def _audit_rewards(audit: Audit, completed, scored: set[str], dead: set[tuple[str, int, int]],
                   reward_committed: dict[int, int]) -> None:
    """Per trajectory, not per record: a completion produced twice (its env member died after producing,
    before committing) carries the same message id, so the reward group scores or dead-letters the first
    copy and de-duplicates the second. The second copy is accounted for by the first's outcome."""
    dead_ids = {m.traj_id for r, m in completed if (r.topic, r.partition, r.offset) in dead}
    audit.scored, audit.reward_dead_lettered = len(scored), len(dead_ids)
    audit.unscored = sorted({m.traj_id for r, m in completed
                             if r.offset < reward_committed.get(r.partition, 0)
                             and m.traj_id not in scored and m.traj_id not in dead_ids})


def _audit_trajectories(audit: Audit, tasks, completions, task_committed: dict[int, int]) -> None:
    ended: dict[str, str] = {}
    aborted: Counter = Counter()
    replacements: dict[str, list[str]] = {}  # group id -> replacement rollouts started in it
    for _, m in completions:
        if isinstance(m, CompletedTrajectory):
            ended.setdefault(m.traj_id, "completed")
        elif isinstance(m, Abort) and m.traj_id not in ended:
            ended[m.traj_id] = f"aborted: {m.reason}"
            if m.replacement:
                replacements.setdefault(m.group_id, []).append(m.replacement)
    for status in ended.values():
        if status == "completed":
            audit.trajectories_completed += 1
        else:
            aborted[status.split(": ", 1)[1]] += 1
    audit.trajectories_aborted = dict(aborted)
    seen = set()
    for record, task in tasks:
        if not isinstance(task, TaskSpec) or task.message_id() in seen:
            continue
        seen.add(task.message_id())
        audit.groups_released += not task.replaces  # a replacement task belongs to its group
        if record.offset >= task_committed.get(record.partition, 0):
            continue  # in flight at the stop: its task is redelivered to whoever runs the env stage next
        audit.groups_settled += not task.replaces
        prefix = task.member_prefix()
        members = [f"{prefix}-{i}" for i in range(task.group_size + task.redundancy)]
        own = [r for r in replacements.get(task.group_id, []) if r.rsplit("-r", 1)[0] == prefix]  # not a sub-task's
        for traj_id in members + own:
            if traj_id not in ended:
                audit.trajectories_lost.append(traj_id)
    audit.replacements = sum(len(r) for r in replacements.values())
    audit.reward_replacements = sum(1 for _, task in tasks if isinstance(task, TaskSpec) and task.replaces)


def longest_stall(record: list[dict], ended_at: float | None) -> float:
    """The longest time between training steps (and from the last one to ``ended_at``): a run that
    stalls trains nothing for minutes while every fault still reads "survived"."""
    times = [row["time"] for row in record if "event" not in row] + ([ended_at] if ended_at else [])
    return round(max((b - a for a, b in zip(times, times[1:])), default=0.0), 3)


def _audit_training(audit: Audit, record: list[dict], alpha: int | None) -> None:
    trained = Counter(t for row in record if "event" not in row for t in row.get("traj_ids", ()))
    audit.trained = sum(trained.values())
    audit.duplicates_trained = sorted(t for t, n in trained.items() if n > 1)
    steps = [row for row in record if "event" not in row]
    audit.staleness_max = max((row["staleness_max"] for row in steps), default=0)
    if alpha is not None:
        audit.over_staleness = sum(1 for row in steps if row["staleness_max"] > alpha)
