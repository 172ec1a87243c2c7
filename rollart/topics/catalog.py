"""The topic catalog: one YAML per logical topic in ``topics/``, expanded for a job.

A logical name such as ``gen.requests.{pool}`` is expanded once per pool; on the wire every topic is
prefixed by the job name (``<job>.<topic>``) so many jobs share one cluster, and every topic has a
dead-letter twin ``<topic>.dlq``.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rollart.config import ConfigError, RollartConfig, format_validation_error
from rollart.messages import MESSAGE_KINDS
from rollart.names import DLQ_SUFFIX  # noqa: F401 - re-exported (rollart.topics)

KIND_BY_NAME = {k.KIND: k for k in MESSAGE_KINDS}
REPO_TOPICS_DIR = Path(__file__).resolve().parents[2] / "topics"


class TopicSpec(BaseModel):
    """One topic of the catalog, exactly as its YAML file says."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._{}-]*$")
    description: str = ""
    key: str
    kinds: tuple[str, ...] = Field(min_length=1)
    partitions: int = Field(ge=1, le=10_000)
    retention_ms: int = Field(ge=-1)
    cleanup_policy: Literal["delete", "compact", "compact,delete"] = "delete"
    per_pool: bool = False
    producers: tuple[str, ...] = ()  # stages (by name or consumer group) that write the topic
    consumers: tuple[str, ...] = ()  # consumer groups that consume it
    # Stages that read it outside any group, from the start (state rebuilt from the log); "*": every stage.
    readers: tuple[str, ...] = ()
    dlq: bool = True
    # The job config section the topic exists for (eval: only a job with ``eval:``); None: every job.
    requires: Literal["eval"] | None = None
    dlq_partitions: int = Field(default=1, ge=1)
    dlq_retention_ms: int = Field(default=30 * 24 * 3600 * 1000, ge=-1)

    @field_validator("kinds")
    @classmethod
    def _known_kinds(cls, kinds: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [k for k in kinds if k not in KIND_BY_NAME]
        if unknown:
            raise ValueError(f"unknown message kinds {unknown}; known: {sorted(KIND_BY_NAME)}")
        return kinds

    @model_validator(mode="after")
    def _check(self) -> "TopicSpec":
        if self.per_pool != ("{pool}" in self.name):
            raise ValueError("per_pool topics must have '{pool}' in their name, and only they")
        return self

    def needed_by(self, config: RollartConfig) -> bool:
        return self.requires is None or getattr(config, self.requires) is not None

    @property
    def message_kinds(self) -> tuple[type, ...]:
        return tuple(KIND_BY_NAME[k] for k in self.kinds)


class PhysicalTopic(BaseModel):
    """A topic as it exists on the broker for one job."""

    model_config = ConfigDict(frozen=True)

    logical: str  # e.g. "gen.requests.h20"
    name: str  # e.g. "myjob.gen.requests.h20"
    partitions: int
    configs: dict[str, str]
    spec: TopicSpec | None = None  # None: a scratch topic outside the catalog
    is_dlq: bool = False


def load_catalog(directory: Path | None = None) -> dict[str, TopicSpec]:
    return dict(_load_catalog(Path(directory or REPO_TOPICS_DIR).resolve()))


@lru_cache(maxsize=8)
def _load_catalog(directory: Path) -> tuple[tuple[str, TopicSpec], ...]:
    if not directory.is_dir():
        raise ConfigError(f"topic catalog directory {directory} does not exist")
    specs: dict[str, TopicSpec] = {}
    for path in sorted(directory.glob("*.yaml")):
        try:
            spec = TopicSpec(**(yaml.safe_load(path.read_text()) or {}))
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, str(path))) from None
        if spec.name in specs:
            raise ConfigError(f"topic {spec.name} is defined twice in {directory}")
        specs[spec.name] = spec
    if not specs:
        raise ConfigError(f"topic catalog {directory} holds no *.yaml topics")
    return tuple(specs.items())


class TopicNames:
    """Logical → physical topic names for one job."""

    def __init__(self, job: str):
        self.job = job

    def physical(self, logical: str) -> str:
        return f"{self.job}.{logical}"

    def dlq(self, physical: str) -> str:
        return physical if physical.endswith(DLQ_SUFFIX) else physical + DLQ_SUFFIX

    def logical(self, physical: str) -> str:
        prefix = self.job + "."
        if not physical.startswith(prefix):
            raise ValueError(f"topic {physical} does not belong to job {self.job}")
        return physical[len(prefix):]


# Room above bus.max_value_bytes for headers and batch overhead (a DLQ record adds error headers).
MESSAGE_OVERHEAD_BYTES = 64 << 10


def _topic_configs(retention_ms: int, cleanup_policy: str, max_message_bytes: int) -> dict[str, str]:
    # Kafka's default max.message.bytes is ~1 MB, far below bus.max_value_bytes (32 MB): without it a
    # large request or trajectory is refused by the broker (RecordTooLargeError), not by our codec.
    return {"retention.ms": str(retention_ms), "cleanup.policy": cleanup_policy,
            "max.message.bytes": str(max_message_bytes)}


def expand_catalog(config: RollartConfig, catalog: dict[str, TopicSpec] | None = None) -> list[PhysicalTopic]:
    """Every topic (and DLQ) the job needs, with pools expanded and the job prefix applied."""
    catalog = catalog if catalog is not None else load_catalog(config.topics)
    names = TopicNames(config.job)
    limit = config.bus.max_value_bytes + MESSAGE_OVERHEAD_BYTES
    out: list[PhysicalTopic] = []
    for spec in (s for s in catalog.values() if s.needed_by(config)):
        logicals = [spec.name.format(pool=p) for p in config.pools] if spec.per_pool else [spec.name]
        for logical in logicals:
            physical = names.physical(logical)
            out.append(PhysicalTopic(logical=logical, name=physical, partitions=spec.partitions,
                                     configs=_topic_configs(spec.retention_ms, spec.cleanup_policy, limit), spec=spec))
            if spec.dlq:
                out.append(PhysicalTopic(logical=logical + DLQ_SUFFIX, name=names.dlq(physical),
                                         partitions=spec.dlq_partitions,
                                         configs=_topic_configs(spec.dlq_retention_ms, "delete",
                                                                limit + MESSAGE_OVERHEAD_BYTES),
                                         spec=spec, is_dlq=True))
    return out


def spec_for(logical: str, catalog: dict[str, TopicSpec]) -> TopicSpec:
    """The catalog entry a logical topic name comes from (``gen.requests.h20`` → ``gen.requests.{pool}``)."""
    if logical in catalog:
        return catalog[logical]
    for spec in catalog.values():
        if spec.per_pool:
            head, _, tail = spec.name.partition("{pool}")
            if logical.startswith(head) and logical.endswith(tail) and len(logical) > len(head) + len(tail):
                return spec
    raise KeyError(f"topic {logical!r} is not in the catalog")
