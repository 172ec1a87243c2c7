"""Code-side declarations equivalent to the ROLLART paper's ``hw_mapping`` and ``register_serverless``.

They say in code what the job config says in YAML:

    @hw_mapping(pool="h20", tags=["math"])
    class MyMathEnv(TextEnv): ...

    @register_serverless(tag="code", url="https://reward.example/score", token_env="REWARD_TOKEN")
    def code_reward(): ...  # the function body is not called: the endpoint scores

    @register_reward(tag="math", timeout_s=5)
    def math_reward(sample) -> float: ...  # called in the reward stage (type python, by import path)

The config wins where both speak: an explicit ``tags.<tag>.pool`` or ``tags.<tag>.reward`` overrides a
declaration; a declaration fills what the config leaves unset. Declarations live in the module that
defines the env, so importing it (as the env registry does for ``package.module:Class``) registers them.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from rollart.config import HttpReward, PythonReward, RewardSpec, RollartConfig

T = TypeVar("T")

_POOLS: dict[str, str] = {}  # tag -> pool
_REWARDS: dict[str, RewardSpec] = {}  # tag -> serverless or python reward


def hw_mapping(*, pool: str, tags: list[str] | tuple[str, ...]) -> Callable[[T], T]:
    """Route these task tags to ``pool`` (hardware affinity, ROLLART R1)."""
    def register(target: T) -> T:
        for tag in tags:
            _POOLS[tag] = pool
        return target
    return register


def register_serverless(*, tag: str, url: str, **options: Any) -> Callable[[T], T]:
    """Score ``tag``'s trajectories with the HTTP function at ``url`` (ROLLART R3)."""
    spec = HttpReward(url=url, **options)

    def register(target: T) -> T:
        _REWARDS[tag] = spec
        return target
    return register


def register_reward(*, tag: str, **options: Any) -> Callable[[T], T]:
    """Score ``tag``'s trajectories with the decorated function (``type: python``, found again by its
    import path in the reward stage: a module-level function, in the module that defines the env)."""
    def register(fn: T) -> T:
        path = f"{fn.__module__}:{fn.__qualname__}"
        if "<locals>" in path:
            raise ValueError(f"register_reward: {path} is not importable (define it at module level)")
        _REWARDS[tag] = PythonReward(function=path, **options)
        return fn
    return register


def apply_declarations(config: RollartConfig) -> RollartConfig:
    """The config with declared pools and rewards filled in where the config is silent."""
    tags = dict(config.tags)
    for tag, spec in config.tags.items():
        updates: dict[str, Any] = {}
        if spec.pool is None and tag in _POOLS:
            updates["pool"] = _POOLS[tag]
        if "reward" not in spec.model_fields_set and tag in _REWARDS:
            updates["reward"] = _REWARDS[tag]
        if updates:
            tags[tag] = spec.model_copy(update=updates)
    unknown = {pool for pool in (tags[t].pool for t in tags) if pool is not None} - set(config.pools)
    if unknown:
        raise ValueError(f"declared pools {sorted(unknown)} are not among the job's pools {config.pools}")
    return config.model_copy(update={"tags": tags})


def clear_declarations() -> None:
    _POOLS.clear()
    _REWARDS.clear()


__all__ = ["apply_declarations", "clear_declarations", "hw_mapping", "register_reward", "register_serverless"]
