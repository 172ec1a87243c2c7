"""``rollart deploy status``: each consumer group's Deployment replicas, its scaler bounds and its lag."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from rollart.deploy.cluster import get
from rollart.deploy.render import Renderer


@dataclass
class StageStatus:
    stage: str
    deployment: str
    exists: bool
    desired: int | None = None  # spec.replicas (KEDA's HPA sets it for autoscaled stages)
    ready: int = 0
    available: int = 0
    min_replicas: int | None = None  # ScaledObject bounds; None: not autoscaled
    max_replicas: int | None = None
    scaler_ready: bool | None = None
    scaler_active: bool | None = None  # KEDA's Active condition: there is lag to work on
    groups: tuple[str, ...] = ()
    lag: dict[str, int] = field(default_factory=dict)  # consumer group -> lag over its topics' partitions

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__, groups=list(self.groups))


def _condition(obj: dict[str, Any] | None, kind: str) -> bool | None:
    for condition in (obj or {}).get("status", {}).get("conditions", []) or []:
        if condition.get("type") == kind:
            return condition.get("status") == "True"
    return None


def stage_groups(renderer: Renderer, stage: str, pool: str | None) -> tuple[str, ...]:
    """Every consumer group a stage's members join (the env stage has two)."""
    from rollart.lag import group_topics

    from rollart.stages.registry import stage_named

    groups = {g for g, *_ in group_topics(renderer.config)}
    return tuple(g for g in stage_named(stage).group_ids(pool) if g in groups)


def deploy_status(renderer: Renderer, api, lag_rows=None) -> list[StageStatus]:
    """Live state of every stage Deployment and ScaledObject; ``lag_rows`` from rollart.lag (or None)."""
    from rollart.deploy import objects

    lag_by_group: dict[str, int] = defaultdict(int)
    for row in lag_rows or []:
        lag_by_group[row.group] += row.lag
    out = []
    for component in renderer.components():
        live = get(api, objects.stage_deployment(renderer, component))
        groups = stage_groups(renderer, component.stage, component.pool)
        status = StageStatus(component.stage if not component.pool else f"generation/{component.pool}",
                             component.name, live is not None, groups=groups,
                             lag={g: lag_by_group[g] for g in groups} if lag_rows is not None else {})
        if live is not None:
            status.desired = live.get("spec", {}).get("replicas")
            live_status = live.get("status", {}) or {}
            status.ready = live_status.get("readyReplicas", 0) or 0
            status.available = live_status.get("availableReplicas", 0) or 0
        if component.spec.autoscaling is not None:
            scaled = get(api, objects.scaled_object(renderer, component))
            if scaled is not None:
                status.min_replicas = scaled["spec"].get("minReplicaCount")
                status.max_replicas = scaled["spec"].get("maxReplicaCount")
                status.scaler_ready = _condition(scaled, "Ready")
                status.scaler_active = _condition(scaled, "Active")
        out.append(status)
    return out
