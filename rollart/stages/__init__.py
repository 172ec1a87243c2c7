"""The stages of the RL loop, each run by its consumer group (see consumers/)."""

# The consumer groups each stage's members join ("{pool}": the member's generation pool). The topic
# catalog names a topic's producers and consumers by these groups (or by the stage's name), so what a
# stage may read and write (rollart.topics.access) follows from the two.
STAGE_GROUPS: dict[str, tuple[str, ...]] = {
    "feeder": (),
    "env": ("env", "env-actions"),
    "generation": ("gen-{pool}",),
    "reward": ("reward", "reward-judge"),
    "trainer": ("trainer",),
    "eval": ("eval",),
}


def stage_needed(stage: str, config) -> bool:
    """Whether the job runs ``stage`` (the eval stage only with an ``eval:`` section)."""
    return stage != "eval" or config.eval is not None


# One member at a time (a Recreate rollout, never autoscaled): the stages that write a sequence alone.
SINGLE_WRITERS = ("feeder", "trainer", "eval")


def prepare_config(config):
    """Import every tag's env class (so a typo fails now, naming the tag, and its ``hw_mapping`` /
    ``register_serverless`` declarations register), then fill the config from those declarations."""
    from rollart.decorators import apply_declarations
    from rollart.envs import UnknownEnvError, resolve_env_class

    for tag, spec in config.tags.items():
        try:
            resolve_env_class(spec.env)
        except UnknownEnvError as exc:
            raise ValueError(f"tags.{tag}.env: {exc}") from None
    return apply_declarations(config)


async def entry(stage: str, config, pool: str | None = None, *, resume: bool = False) -> None:
    """Run one member of ``stage`` (the body of `rollart consume` and of consumers/*). SIGTERM is
    honoured from here on, start-up included (see :mod:`rollart.bus.stopping`)."""
    from rollart.bus.stopping import StopRequest

    stop = StopRequest.installed()
    config = prepare_config(config)
    if stage == "feeder":
        from rollart.stages.feeder import run_feeder

        await run_feeder(config, stop)
    elif stage == "env":
        from rollart.stages.env import run_env

        await run_env(config, stop)
    elif stage == "generation":
        from rollart.stages.generation import run_generation

        await run_generation(config, pool, stop)
    elif stage == "reward":
        from rollart.stages.reward import run_reward

        await run_reward(config, stop)
    elif stage == "trainer":
        from rollart.stages.trainer import run_trainer

        await run_trainer(config, stop, resume=resume)
    elif stage == "eval":
        from rollart.stages.evaluation import run_eval

        await run_eval(config, stop)
    else:
        raise ValueError(f"unknown stage {stage!r}")
