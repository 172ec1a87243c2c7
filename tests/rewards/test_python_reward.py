"""Python reward functions by import path: sync and async, components, failures, timeout, the bound on
concurrency, start-up checks, and the reward stage dead-lettering a trajectory whose function raised."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace

import pytest

from rollart.bus.dlq import H_DLQ_ERROR
from rollart.bus.reader import read_to_end
from rollart.config import ConfigError, PythonReward as PythonRewardSpec, RollartConfig, build_config
from rollart.messages import Abort, ScoredTrajectory
from rollart.messages.samples import sample_trajectory
from rollart.rewards.http import RewardCallFailed
from rollart.rewards.python import PythonReward
from rollart.rewards.scoring import LocalScorer, scored_trajectory
from rollart.runtime import open_runtime
from rollart.stages.reward import RewardBridge, check_rewards, reward_loops
from rollart.topics import expand_catalog
from rollart.topics.admin import apply_topics
from tests.conftest import RunningLoops, eventually, make_config
from tests.rewards import python_rewards
from tests.rewards.test_serverless_bridge import _dlq

FUNCTIONS = "tests.rewards.python_rewards"


def spec(function: str, **options) -> PythonRewardSpec:
    return PythonRewardSpec(function=f"{FUNCTIONS}:{function}", **options)


async def test_sync_and_async_functions_score_with_the_env_reward(chat):
    scorer = LocalScorer(chat)
    trajectory = replace(sample_trajectory("g1-0"), labels={"answer": "\u2603"})  # not in the final text
    sample = scorer.reward_input(trajectory)
    assert sample.text == chat.decode(trajectory.token_ids) and len(sample.token_ids) == 16
    assert sample.labels == {"answer": "\u2603"} and sample.env_reward == 1.0 and sample.trajectory is trajectory
    try:
        reward, components = await scorer.score(trajectory, spec("by_answer"))  # 1 / turns, plus the env's 1.0
        assert (reward, components) == (1.5, {"env": 1.0, "python": 0.5})
        reward, components = await scorer.score(trajectory, spec("async_components", include_env_reward=False))
        assert components == {"env": 1.0, "length": 0.16, "bonus": 0.5} and reward == pytest.approx(0.66)
        scored = scored_trajectory(trajectory, reward, components, spec("async_components"))
        assert scored.scorer == f"python:{FUNCTIONS}:async_components"
    finally:
        await scorer.close()


@pytest.mark.parametrize("function, error, match", [
    ("raises", RewardCallFailed, "raised RuntimeError: cannot judge g1-0"),
    ("not_a_number", ValueError, "returned reward 'high': expected a finite number"),
    ("nan", ValueError, "returned reward nan"),
    ("hangs", RewardCallFailed, "took longer than 0.2s"),
    ("slow", RewardCallFailed, "took longer than 0.2s"),
])
async def test_a_failing_function_fails_the_trajectory_with_the_reason(chat, function, error, match):
    reward = PythonReward(spec(function, timeout_s=0.2))
    try:
        with pytest.raises(error, match=match):
            await reward.score(LocalScorer(chat).reward_input(sample_trajectory("g1-0")))
    finally:
        reward.close()


async def test_a_plain_function_runs_off_the_loop_bounded_and_keeps_its_slot_past_a_timeout(chat):
    reward = PythonReward(spec("slow", concurrency=2, timeout_s=0.2))
    sample = LocalScorer(chat).reward_input(sample_trajectory())
    while python_rewards.running["now"]:  # a thread the timeout test left sleeping
        await asyncio.sleep(0.05)
    python_rewards.running["most"] = 0
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.create_task(tick())
    try:
        outcomes = await asyncio.gather(*[reward.score(sample) for _ in range(4)], return_exceptions=True)
    finally:
        ticker.cancel()
        reward.close()
    assert all(isinstance(o, RewardCallFailed) for o in outcomes), outcomes
    # the two calls past the bound waited for threads that were still sleeping after their timeout
    assert python_rewards.running["most"] == 2
    assert ticks > 10, "a sleeping reward function blocked the event loop"


def test_the_config_and_the_start_up_name_what_is_wrong():
    with pytest.raises(ConfigError, match=r"tags.mine.reward: .*type python needs a function"):
        build_config({"tags": {"mine": {"env": "frozenlake", "reward": {"type": "python"}}}}, "test")
    with pytest.raises(ConfigError, match=r"tags.mine.reward.function"):
        build_config({"tags": {"mine": {"env": "frozenlake", "reward": {"type": "python", "function": "fn"}}}}, "t")
    for function, match in [("tests.rewards.nowhere:fn", "cannot import reward function"),
                            (f"{FUNCTIONS}:missing", "cannot import reward function"),
                            (f"{FUNCTIONS}:NOT_CALLABLE", "is a int, not a callable")]:
        config = RollartConfig(tags={"mine": {"env": "frozenlake", "reward": {"type": "python", "function": function}}})
        with pytest.raises(ConfigError, match=f"tags.mine.reward: .*{match}"):
            check_rewards(config)
    check_rewards(RollartConfig(tags={"ok": {"env": "frozenlake", "reward": spec("by_answer").model_dump()}}))


@contextlib.asynccontextmanager
async def reward_stage(config, chat, trajectories, collect):
    """The reward stage and a collector of rewards.results on the real broker; ``trajectories`` sent."""
    loops = RunningLoops()
    async with open_runtime(config, serve=False) as rt:
        bridge = RewardBridge(rt, chat)
        try:
            await loops.start(reward_loops(rt, bridge)[0])
            await loops.start(rt.consumer_loop("collector", ["rewards.results"], collect, dedup=False),
                              wait_assigned=False)
            for trajectory in trajectories:
                await rt.producer.send_and_wait("trajectories.completed", trajectory, key=trajectory.group_id)
            yield rt
        finally:
            await loops.stop_all()
            await bridge.close()


async def test_the_reward_stage_scores_by_function_and_dead_letters_what_raised(endpoints, chat, tiny_model):
    config = make_config(endpoints, model={"path": str(tiny_model), "init_tiny": False},
                         tags={"py": {"env": "frozenlake", "reward": spec("async_components").model_dump()},
                               "bad": {"env": "frozenlake", "reward": spec("raises").model_dump()}})
    await apply_topics(config, endpoints, expand_catalog(config))
    good = [replace(sample_trajectory(f"p{i}-0"), tag="py") for i in range(3)]
    bad = replace(sample_trajectory("b0-0"), tag="bad")
    scored, told = {}, []

    async def collect(envelope, ctx) -> None:
        message = envelope.message
        if isinstance(message, ScoredTrajectory):
            scored[message.trajectory.traj_id] = message
        else:
            told.append(message)

    async with reward_stage(config, chat, [good[0], bad, *good[1:]], collect) as rt:
        await eventually(lambda: len(scored) == 3 and told, what="3 scored, the raising one told")
        dead = await eventually(lambda: _dlq(rt), what="the trajectory whose function raised, dead-lettered")
    assert {s.scorer for s in scored.values()} == {f"python:{FUNCTIONS}:async_components"}
    assert [s.reward for s in scored.values()] == [pytest.approx(0.16 + 0.5 + 1.0)] * 3, "components plus the env reward"
    assert "raised RuntimeError: cannot judge b0-0" in dict(dead[0].headers)[H_DLQ_ERROR].decode()
    assert [(m.traj_id, m.reason) for m in told if isinstance(m, Abort)] == [("b0-0", "reward_failed")]


async def test_a_dead_lettered_member_gets_a_replacement_task_until_its_lineage_runs_out(endpoints, chat, tiny_model):
    from rollart.messages import DEFAULT_CODEC, TaskSpec
    from rollart.stages.feeder import sources_from, task_spec

    config = make_config(endpoints, model={"path": str(tiny_model), "init_tiny": False},
                         tags={"bad": {"env": "frozenlake", "reward": spec("raises").model_dump()}})
    await apply_topics(config, endpoints, expand_catalog(config))
    job = config.job
    first = replace(sample_trajectory(f"{job}-g5-1"), group_id=f"{job}-g5", tag="bad", start_version=2)
    spent = replace(sample_trajectory(f"{job}-g6-0" + ".d-0" * 4), group_id=f"{job}-g6", tag="bad")  # 4 = the bound
    told = []

    async def collect(envelope, ctx) -> None:
        told.append(envelope.message)

    async with reward_stage(config, chat, (first, spent), collect):
        await eventually(lambda: len(told) == 2, what="both told to the trainer")
        tasks = [DEFAULT_CODEC.decode(r.value, r.headers).message
                 async for r in read_to_end(config, endpoints, f"{job}.tasks")]
    replacements = {m.traj_id: m.replacement for m in told}
    assert replacements == {first.traj_id: f"{first.traj_id}.d-0", spent.traj_id: ""}
    assert len(tasks) == 1 and isinstance(tasks[0], TaskSpec)
    task, original = tasks[0], task_spec(config, sources_from(config), 5)
    assert (task.group_id, task.replaces, task.group_size, task.redundancy) == (f"{job}-g5", first.traj_id, 1, 0)
    assert (task.seed, task.env, task.tag, task.admitted_version) == (original.seed, original.env, original.tag, 2)
