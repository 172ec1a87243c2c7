"""The stages of the RL loop, each run by its consumer group (see consumers/); declared once in
:mod:`rollart.stages.registry`."""

from rollart.stages.registry import STAGES, Stage, run_stage, stage_named

__all__ = ["STAGES", "Stage", "entry", "prepare_config", "run_stage", "stage_named"]


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

    spec = stage_named(stage)
    stop = StopRequest.installed()
    config = prepare_config(config)
    options = {"pool": pool, "resume": resume}
    await run_stage(stage, config, stop, **{k: v for k, v in options.items() if k in spec.options})
