"""Replay over real topics, on both brokers: filters (tag, reward range, abort reason, policy
version), where reading starts (a time, an offset), ``--follow`` (one trajectory across every topic)
and ``--refeed-to`` (a copy into another job, exactly once)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from rollart.messages import Abort, GenerationRequest, GenerationResult, Int32Array, ScoredTrajectory, TaskSpec
from rollart.messages.samples import sample_messages, sample_trajectory
from rollart.refeed import refeed
from rollart.replay import ReplayFilter, replay
from rollart.trace import trace
from tests.conftest import ALL_BROKERS

pytestmark = ALL_BROKERS  # the broker contract


def _scored(i: int, *, tag: str, reward: float, version: int) -> ScoredTrajectory:
    t = replace(sample_trajectory(f"g{i}-t0", version=version), tag=tag)
    t = replace(t, versions=Int32Array([-1 if m == 0 else version for m in t.loss_mask]))
    return ScoredTrajectory(trajectory=t, reward=reward)


async def _ids(runtime, topic: str, **filters) -> list[str]:
    found = []
    async for _, message in replay(runtime.config, runtime.endpoints, topic, ReplayFilter(**filters)):
        found.append(message.trajectory.traj_id if isinstance(message, ScoredTrajectory) else message.traj_id)
    return found


async def test_filters_select_by_tag_reward_reason_and_version(runtime):
    items = [_scored(0, tag="math", reward=1.0, version=2), _scored(1, tag="frozenlake", reward=0.0, version=2),
             _scored(2, tag="math", reward=-0.1, version=3), _scored(3, tag="frozenlake", reward=0.5, version=3)]
    for item in items:
        await runtime.producer.send_and_wait("rewards.results", item, key=item.trajectory.group_id)
    for traj, reason in (("g7-t0", "stale"), ("g8-t0", "env_step_timeout")):
        await runtime.producer.send_and_wait("trajectories.completed", Abort(traj_id=traj, turn=1, reason=reason),
                                             key=traj)
    assert sorted(await _ids(runtime, "rewards.results", tag="math")) == ["g0-t0", "g2-t0"]
    assert sorted(await _ids(runtime, "rewards.results", min_reward=0.0, max_reward=0.6)) == ["g1-t0", "g3-t0"]
    assert sorted(await _ids(runtime, "rewards.results", policy_version=3)) == ["g2-t0", "g3-t0"]
    assert sorted(await _ids(runtime, "rewards.results", tag="frozenlake", policy_version=2)) == ["g1-t0"]
    assert await _ids(runtime, "trajectories.completed", abort_reason="stale") == ["g7-t0"]
    assert await _ids(runtime, "rewards.results", abort_reason="stale") == [], "scored trajectories are no aborts"


async def test_replay_starts_at_a_time_or_an_offset_not_at_the_beginning(runtime):
    """The reader seeks (offsets_for_times, a given offset) rather than reading the topic from 0."""
    early = [_scored(i, tag="math", reward=0.0, version=1) for i in range(4)]
    for item in early:
        await runtime.producer.send_and_wait("rewards.results", item, key="same")
    await asyncio.sleep(0.05)
    since_ms = int(time.time() * 1000)
    late = [_scored(i, tag="math", reward=1.0, version=2) for i in range(4, 7)]
    metas = [await runtime.producer.send_and_wait("rewards.results", item, key="same") for item in late]
    assert await _ids(runtime, "rewards.results", since_ms=since_ms) == ["g4-t0", "g5-t0", "g6-t0"]
    partition, offset = metas[1].partition, metas[1].offset
    assert await _ids(runtime, "rewards.results", partition=partition, from_offset=offset) == ["g5-t0", "g6-t0"]
    assert await _ids(runtime, "rewards.results", since_ms=int(time.time() * 1000) + 60_000) == []


def _one_trajectory(traj_id: str) -> list[tuple[str, object]]:
    """The records one trajectory leaves on the job's topics, in loop order."""
    group = traj_id.split("-")[0]
    trajectory = sample_trajectory(traj_id)
    request, result = (m for m in sample_messages() if isinstance(m, (GenerationRequest, GenerationResult)))
    return [("tasks", TaskSpec(group_id=group, env="frozenlake", tag="frozenlake", group_size=1)),
            ("gen.requests.default", replace(request, traj_id=traj_id, group_id=group)),
            ("env.actions", replace(result, traj_id=traj_id)),
            ("trajectories.completed", trajectory),
            ("rewards.results", ScoredTrajectory(trajectory=trajectory, reward=1.0, scorer="rule"))]


async def test_follow_gathers_one_trajectory_across_topics_in_loop_order(runtime):
    for traj_id in ("g1-t0", "g2-t0"):  # a neighbour that must not show up
        for topic, message in _one_trajectory(traj_id):
            await runtime.producer.send_and_wait(topic, message, key=traj_id)
    entries = await trace(runtime.config, runtime.endpoints, "g1-t0")
    assert [e.topic for e in entries] == ["tasks", "gen.requests.default", "env.actions", "trajectories.completed",
                                          "rewards.results"]
    assert entries[0].message.group_id == "g1", "the trajectory's own group's task, not the neighbour's"


async def test_refeed_copies_selected_messages_into_a_new_job_once(runtime):
    items = [_scored(i, tag="math" if i % 2 else "frozenlake", reward=float(i), version=1) for i in range(6)]
    for item in items:
        await runtime.producer.send_and_wait("rewards.results", item, key=item.trajectory.group_id)
    to_job = f"{runtime.config.job}-refed"
    flt = ReplayFilter(tag="math")
    first = await refeed(runtime.config, runtime.endpoints, "rewards.results", flt, to_job=to_job)
    again = await refeed(runtime.config, runtime.endpoints, "rewards.results", flt, to_job=to_job)
    assert (first.selected, first.produced, first.already_there) == (3, 3, 0)
    assert (again.selected, again.produced, again.already_there) == (3, 0, 3), "a second re-feed writes nothing"
    copied = runtime.config.model_copy(update={"job": to_job})
    found = [m.trajectory.traj_id async for _, m in replay(copied, runtime.endpoints, "rewards.results",
                                                           ReplayFilter())]
    assert sorted(found) == ["g1-t0", "g3-t0", "g5-t0"]
    source = [m async for _, m in replay(runtime.config, runtime.endpoints, "rewards.results", ReplayFilter())]
    assert len(source) == 6, "the source is untouched"
