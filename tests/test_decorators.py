"""hw_mapping / register_serverless declare in code what the config says; the config wins."""

from __future__ import annotations

import pytest

from rollart.config import build_config
from rollart.decorators import apply_declarations, clear_declarations, hw_mapping, register_reward, register_serverless


@pytest.fixture(autouse=True)
def clean():
    clear_declarations()
    yield
    clear_declarations()


def test_declarations_fill_what_the_config_leaves_unset():
    @hw_mapping(pool="h20", tags=["math", "code"])
    @register_serverless(tag="code", url="https://reward.example/score", token_env="TOKEN", timeout_s=3)
    class CodeEnv:
        pass

    config = build_config({"pools": ["h800", "h20"], "tags": {
        "math": {"env": "math"},
        "code": {"env": "math"},
        "grid": {"env": "frozenlake", "pool": "h800"},
    }})
    applied = apply_declarations(config)
    assert applied.pool_for("math") == "h20" and applied.pool_for("code") == "h20"
    assert applied.pool_for("grid") == "h800"
    reward = applied.tags["code"].reward
    assert (reward.type, reward.url, reward.timeout_s, reward.token_env) == ("http", "https://reward.example/score",
                                                                          3, "TOKEN")
    assert applied.tags["math"].reward.type == "env"


def test_the_config_wins_and_unknown_pools_fail():
    hw_mapping(pool="h20", tags=["math"])(object)
    register_serverless(tag="math", url="https://x.example/s")(object)
    config = build_config({"pools": ["h800", "h20"], "tags": {
        "math": {"env": "math", "pool": "h800", "reward": {"type": "rule", "rule": "math_answer"}}}})
    applied = apply_declarations(config)
    assert applied.pool_for("math") == "h800" and applied.tags["math"].reward.type == "rule"
    hw_mapping(pool="tpu", tags=["grid"])(object)
    with pytest.raises(ValueError, match="tpu"):
        apply_declarations(build_config({"tags": {"grid": {"env": "frozenlake"}}}))


def test_a_registered_python_reward_is_found_by_its_import_path():
    from rollart.stages.reward import check_rewards
    from tests.rewards import python_rewards

    register_reward(tag="math", timeout_s=2)(python_rewards.by_answer)
    applied = apply_declarations(build_config({"tags": {"math": {"env": "math"}}}))
    reward = applied.tags["math"].reward
    assert (reward.type, reward.function, reward.timeout_s) == ("python", "tests.rewards.python_rewards:by_answer", 2)
    check_rewards(applied)  # the reward stage can import it
    with pytest.raises(ValueError, match="not importable"):
        register_reward(tag="math")(lambda sample: 1.0)
