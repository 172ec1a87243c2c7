"""Built-in environments, the registry and fault injection."""

from __future__ import annotations

import asyncio
from collections import deque

import pytest

from rollart.envs import (
    FORMAT_PENALTY,
    ArithmeticMath,
    EnvFailure,
    FaultSpec,
    FaultyEnv,
    FrozenLake,
    Sokoban,
    UnknownEnvError,
    make_env,
)
from rollart.envs.grid import MOVES
from rollart.envs.math import extract_answer
from rollart.timeouts import wait_for


def test_frozenlake_reaches_the_goal_and_falls_in_holes():
    env = FrozenLake()
    assert env.reset_sync(0).splitlines()[0] == "P _ _ _"
    for move in ("Down", "Down", "Right", "Right", "Down"):
        result = env.step_sync(f"I go {move.lower()}")
        assert not result.done
    result = env.step_sync("Right")
    assert result.done and result.reward == 1.0 and result.info["success"]
    env.reset_sync(0)
    env.step_sync("Right")
    fell = env.step_sync("Down")
    assert fell.done and fell.reward == 0.0 and fell.info["fell"]


def test_unparseable_actions_get_the_format_penalty_and_change_nothing():
    for env in (FrozenLake(), Sokoban()):
        before = env.reset_sync(3)
        result = env.step_sync("\x00garbage 123 ✓")
        assert result.reward == FORMAT_PENALTY and not result.done and result.info["invalid_action"]
        assert result.observation == before
    math = ArithmeticMath()
    math.reset_sync(1)
    assert math.step_sync("no idea").reward == FORMAT_PENALTY


def _solvable(env: Sokoban) -> bool:
    """Breadth-first search over (player, box) states."""
    start = (env.player, env.box)
    seen, queue = {start}, deque([start])
    while queue:
        player, box = queue.popleft()
        if box == env.target:
            return True
        for dr, dc in MOVES.values():
            nxt = (player[0] + dr, player[1] + dc)
            new_box = box
            if not env._inside(*nxt):
                continue
            if nxt == box:
                new_box = (box[0] + dr, box[1] + dc)
                if not env._inside(*new_box):
                    continue
            state = (nxt, new_box)
            if state not in seen:
                seen.add(state)
                queue.append(state)
    return False


@pytest.mark.parametrize("seed", range(20))
def test_sokoban_rooms_are_solvable_and_deterministic(seed):
    env = Sokoban()
    first = env.reset_sync(seed)
    assert env.box != env.target and _solvable(env)
    assert Sokoban().reset_sync(seed) == first


def test_math_checks_the_verified_answer_over_turns():
    env = ArithmeticMath()
    question = env.reset_sync(7)
    assert question.startswith("What is") and env.episode_labels()["answer"] == env.answer
    wrong = env.step_sync(str(int(env.answer) + 1))
    assert not wrong.done and wrong.observation == "Incorrect. Try again."
    right = env.step_sync(f"It is \\boxed{{{env.answer}}}")
    assert right.done and right.reward == 1.0
    env.reset_sync(0, prompt="What is 6 * 7?", labels={"answer": "42"})
    assert env.step_sync("42").done
    with pytest.raises(ValueError, match="answer"):
        env.reset_sync(0, prompt="no label")
    assert extract_answer("a 1 then 2.5") == "2.5" and extract_answer("none") is None


def test_registry_builtins_and_import_paths():
    assert isinstance(make_env("sokoban", {"size": 7}), Sokoban)
    assert isinstance(make_env("rollart.envs.grid:FrozenLake"), FrozenLake)
    with pytest.raises(UnknownEnvError, match="unknown env"):
        make_env("nethack")
    with pytest.raises(UnknownEnvError, match="cannot import"):
        make_env("no.such.module:Env")


async def test_fault_injection_latency_failures_and_hangs():
    slow = FaultyEnv(FrozenLake(), FaultSpec(step_latency={"dist": "fixed", "mean_s": 0.05}), rng_seed=1)
    await slow.reset(0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    await slow.step("Right")
    assert loop.time() - started >= 0.05
    broken = FaultyEnv(FrozenLake(), FaultSpec(reset_failure_rate=1.0), rng_seed=1)
    with pytest.raises(EnvFailure):
        await broken.reset(0)
    hanging = FaultyEnv(FrozenLake(), FaultSpec(hang_rate=1.0), rng_seed=1)
    await hanging.reset(0)
    with pytest.raises(asyncio.TimeoutError):
        await wait_for(hanging.step("Right"), 0.1)
    gaussian = FaultSpec(step_latency={"dist": "gaussian", "mean_s": 0.02, "sigma_s": 0.02}).step_latency
    import random
    draws = [gaussian.draw(random.Random(i)) for i in range(200)]
    assert min(draws) >= 0 and 0.01 < sum(draws) / len(draws) < 0.03
