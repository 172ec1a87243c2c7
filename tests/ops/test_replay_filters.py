"""Replay filters (tag, reward range, abort reason, policy version) over a real topic."""

from __future__ import annotations

from dataclasses import replace

from rollart.messages import Abort, Int32Array, ScoredTrajectory
from rollart.messages.samples import sample_trajectory
from rollart.replay import ReplayFilter, replay


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
