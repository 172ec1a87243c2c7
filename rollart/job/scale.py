"""Elastic stages on a running local job: ``rollart scale JOB STAGE N [--pool P]``.

The request is a field of the job's ``stage:members`` Redis hash (``env`` or ``generation:<pool>`` →
members). The run's supervisor reads the hash every round and reconciles: it starts the missing
members (they join the stage's consumer groups, which rebalance onto them) and retires the extra ones
with SIGTERM, so a leaving member drains what it holds, commits and hands its partitions to the
others instead of losing work. Only stages that may have several members scale (not the trainer,
the feeder or the eval stage: single writers).

A Redis flush loses a request not yet applied, never the run's state: an absent field means "as
now", so the supervisor keeps the members it has.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from rollart.config import ConfigError, RollartConfig
from rollart.local.processes import StageProcesses
from rollart.names import RedisKeys
from rollart.stages.registry import STAGES, Stage

log = logging.getLogger(__name__)

MAX_MEMBERS = 16  # a local run on one machine; a cluster scales its Deployments instead


@dataclass(frozen=True)
class ScaleRequest:
    stage: str
    members: int
    pool: str | None = None

    @property
    def field(self) -> str:
        return self.stage if self.pool is None else f"{self.stage}:{self.pool}"

    @classmethod
    def parse(cls, field: str, value: str | bytes) -> "ScaleRequest":
        stage, _, pool = (field.decode() if isinstance(field, bytes) else field).partition(":")
        return cls(stage, int(value), pool or None)


def validated(config: RollartConfig, request: ScaleRequest) -> ScaleRequest:
    """The request, or a ConfigError naming what is wrong with it."""
    stage = STAGES.get(request.stage)
    if stage is None:
        raise ConfigError(f"stage: {request.stage!r} is not a stage; choose one of {', '.join(STAGES)}")
    if stage.single_writer:
        raise ConfigError(f"stage: {stage.name} runs one member at a time (a single writer); it does not scale")
    pools = stage.pools(config)
    if not pools:
        raise ConfigError(f"stage: this job runs no {stage.name} members"
                          + (" (env.colocate_pool: scale envgen)" if config.env.colocate_pool else ""))
    if stage.per_pool and request.pool not in pools:
        raise ConfigError(f"--pool: {stage.name} scales per pool; choose one of {', '.join(map(str, pools))}")
    if not stage.per_pool and request.pool is not None:
        raise ConfigError(f"--pool: {stage.name} has no pools")
    if not 1 <= request.members <= MAX_MEMBERS:
        raise ConfigError(f"members: {request.members} is outside 1..{MAX_MEMBERS}")
    return request


async def request_scale(redis, config: RollartConfig, request: ScaleRequest) -> None:
    """Ask the job's supervisor for ``request.members`` members (it applies it within a second)."""
    validated(config, request)
    await redis.hset(RedisKeys.of(config).stage_members, request.field, request.members)


def members_of(procs: StageProcesses, stage: Stage, pool: str | None) -> list[int]:
    """Indices of the live (supervised) members of ``stage`` in ``pool``."""
    return [i for i in range(MAX_MEMBERS) if stage.member_name(pool, i) in procs.stages]


class Scaler:
    """Reconciles a run's members with the job's requests; call :meth:`reconcile` every round."""

    def __init__(self, config: RollartConfig, procs: StageProcesses):
        self.config = config
        self.procs = procs
        self.key = RedisKeys.of(config).stage_members
        self.retired: dict[str, int | None] = {}  # member -> exit code (0: it drained and left)

    async def reconcile(self, redis) -> None:
        self.retired.update(self.procs.reap_retired())
        for field, value in (await redis.hgetall(self.key)).items():
            try:
                request = validated(self.config, ScaleRequest.parse(field, value))
            except (ConfigError, ValueError) as exc:
                log.warning("ignoring the scale request %s=%s: %s", field, value, exc)
                await redis.hdel(self.key, field)
                continue
            self._apply(STAGES[request.stage], request.pool, request.members)

    def _apply(self, stage: Stage, pool: str | None, members: int) -> None:
        current = members_of(self.procs, stage, pool)
        for i in range(members):
            name = stage.member_name(pool, i)
            if i not in current and name not in self.procs.retiring:  # (a leaving namesake goes first)
                log.info("scale: starting %s", name)
                self.procs.start(name, *stage.command(pool))
        for i in current:
            if i >= members:
                log.info("scale: retiring %s (it drains, commits and leaves its groups)", stage.member_name(pool, i))
                self.procs.retire(stage.member_name(pool, i), grace_s=self.config.bus.drain_timeout_s + 30)
