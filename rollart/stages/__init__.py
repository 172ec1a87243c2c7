"""The stages of the RL loop, each run by its consumer group (see consumers/)."""


async def entry(stage: str, config, pool: str | None = None) -> None:
    """Run one member of ``stage`` (the body of `rollart consume` and of consumers/*)."""
    if stage == "feeder":
        from rollart.stages.feeder import run_feeder

        await run_feeder(config)
    elif stage == "env":
        from rollart.stages.env import run_env

        await run_env(config)
    elif stage == "generation":
        from rollart.stages.generation import run_generation

        await run_generation(config, pool)
    elif stage == "reward":
        from rollart.stages.reward import run_reward

        await run_reward(config)
    else:
        raise ValueError(f"unknown stage {stage!r}")
