"""What each stage may read and write on the broker, derived from the topic catalog.

One principal per stage (a stage's members share it; a generation pool is its own stage): it may
read the topics its consumer groups consume, and those the catalog lets it read outside a group
(``readers``); join its groups; write the topics it produces and the DLQs of the topics it consumes
(its consumer loops dead-letter there). Nothing else. The local stack turns these into Kafka ACLs,
``rollart deploy render`` into Strimzi ``KafkaUser`` resources.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollart.config import RollartConfig
from rollart.topics.catalog import DLQ_SUFFIX, load_catalog


@dataclass(frozen=True)
class StageAccess:
    stage: str
    pool: str | None
    principal: str  # the SASL user name, e.g. "demo-gen-h20"
    groups: tuple[str, ...]  # physical consumer group ids
    read: tuple[str, ...]  # physical topics
    write: tuple[str, ...]

    @property
    def component(self) -> str:
        return f"generation/{self.pool}" if self.pool else self.stage


def stage_principal(job: str, stage: str, pool: str | None = None) -> str:
    from rollart.deploy.render import k8s_name
    from rollart.stages.registry import stage_named

    return k8s_name(job, stage_named(stage).label(), *([pool] if pool else []))


def stage_access(config: RollartConfig, stage: str, pool: str | None = None) -> StageAccess:
    """The topics and groups one stage's principal is allowed (``pool`` for generation only)."""
    from rollart.stages.registry import stage_named

    spec_of_stage = stage_named(stage)
    if spec_of_stage.per_pool != (pool is not None):
        raise ValueError("a pool names a generation stage, and only that")
    own_groups = set(spec_of_stage.group_ids(pool))
    names = own_groups | {stage, *spec_of_stage.hosts}  # a co-located stage does what its hosted stages do
    read: set[str] = set()
    write: set[str] = set()
    for spec in (s for s in load_catalog(config.topics).values() if s.needed_by(config)):
        for topic_pool in (config.pools if spec.per_pool else [pool]):
            def named(entries: tuple[str, ...], topic_pool: str | None = topic_pool) -> set[str]:
                return {e.format(pool=topic_pool) if topic_pool else e for e in entries}

            physical = f"{config.job}.{spec.name.format(pool=topic_pool)}" if spec.per_pool \
                else f"{config.job}.{spec.name}"
            consumed = bool(names & named(spec.consumers))
            if consumed or stage in spec.readers or "*" in spec.readers:
                read.add(physical)
            if names & named(spec.producers):
                write.add(physical)
            if consumed and spec.dlq:
                write.add(physical + DLQ_SUFFIX)
    groups = tuple(sorted(f"{config.job}.{g}" for g in own_groups))
    return StageAccess(stage, pool, stage_principal(config.job, stage, pool), groups,
                       tuple(sorted(read)), tuple(sorted(write)))


def job_access(config: RollartConfig) -> list[StageAccess]:
    """Every stage's access, one generation entry per pool."""
    from rollart.stages.registry import STAGES

    return [stage_access(config, stage.name, pool) for stage in STAGES.values() for pool in stage.pools(config)]
