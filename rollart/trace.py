"""Follow one trajectory across every topic of a job: its task, each turn's request and result,
aborts, the completed trajectory, its score, and any copy in a DLQ, in the order they happened.

Reads outside consumer groups (see rollart.bus.reader), so it cannot disturb a running job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollart.config import RollartConfig
from rollart.endpoints import Endpoints
from rollart.messages import Abort, CompletedTrajectory, GenerationRequest, GenerationResult, MessageDecodeError, \
    ScoredTrajectory, TaskSpec
from rollart.replay import ReplayFilter, replay
from rollart.topics import expand_catalog
from rollart.names import DLQ_SUFFIX, ENV_ACTIONS, GEN_REQUESTS, POLICY_VERSIONS, REWARDS_JUDGE, REWARDS_RESULTS, TASKS, TRAJECTORIES_COMPLETED

# The order of the RL loop, for records written in the same millisecond.
STAGE_ORDER = (TASKS, GEN_REQUESTS.split(".{")[0], ENV_ACTIONS, TRAJECTORIES_COMPLETED, REWARDS_JUDGE, REWARDS_RESULTS)


@dataclass(frozen=True)
class TraceEntry:
    topic: str  # logical
    record: Any
    message: Any


def group_of(message: Any) -> str | None:
    if isinstance(message, ScoredTrajectory):
        message = message.trajectory
    if isinstance(message, (GenerationRequest, Abort, CompletedTrajectory)):
        return message.group_id or None
    return None


def _stage_rank(topic: str) -> int:
    for rank, prefix in enumerate(STAGE_ORDER):
        if topic.startswith(prefix):
            return rank
    return len(STAGE_ORDER)


async def trace(config: RollartConfig, endpoints: Endpoints, traj_id: str) -> list[TraceEntry]:
    """Every record about ``traj_id`` (and its group's task), oldest first."""
    topics = [t.logical for t in expand_catalog(config) if t.logical not in (TASKS, POLICY_VERSIONS)]
    entries: list[TraceEntry] = []
    groups: set[str] = set()
    for topic in topics:
        async for record, message in replay(config, endpoints, topic, ReplayFilter(traj_id=traj_id)):
            if isinstance(message, MessageDecodeError):
                continue
            entries.append(TraceEntry(topic, record, message))
            if group_of(message):
                groups.add(group_of(message))
    for topic in (TASKS, TASKS + DLQ_SUFFIX):
        async for record, message in replay(config, endpoints, topic, ReplayFilter()):
            if isinstance(message, TaskSpec) and message.group_id in groups:
                entries.append(TraceEntry(topic, record, message))
    entries.sort(key=lambda e: (e.record.timestamp, _stage_rank(e.topic), e.record.offset))
    return entries


def describe(entry: TraceEntry) -> str:
    """One line per record: when, where, what."""
    m, r = entry.message, entry.record
    where = f"{entry.topic}[{r.partition}]@{r.offset}"
    if isinstance(m, TaskSpec):
        what = f"task group={m.group_id} tag={m.tag} size={m.group_size} admitted at v{m.admitted_version}"
    elif isinstance(m, GenerationRequest):
        what = f"request turn={m.turn} attempt={m.attempt} pool={m.pool} context={len(m.prompt_ids)} tokens"
    elif isinstance(m, Abort):
        what = f"abort turn={m.turn} reason={m.reason}"
    elif isinstance(m, ScoredTrajectory):
        what = f"scored reward={m.reward:g} by {m.scorer or '?'}"
    elif isinstance(m, CompletedTrajectory):
        what = f"completed status={m.status} turns={m.turns} env_reward={m.env_reward:g}"
    elif isinstance(m, GenerationResult):
        what = f"result turn={m.turn} {m.finish_reason} {len(m.token_ids)} tokens v{max(m.versions, default=-1)}"
    else:
        what = type(m).__name__
    return f"{r.timestamp}  {where:<40} {what}"
