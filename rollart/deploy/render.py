"""Render a job config into Kubernetes objects: one Deployment per consumer group, scaled by KEDA.

What comes out (all in ``deploy.namespace``, labelled ``app.kubernetes.io/instance=<job>``):

* a ConfigMap with the job config as the pods see it (in-cluster endpoints filled in);
* a Deployment per stage: feeder, env, one ``gen-<pool>`` per generation pool (its hardware class:
  node selector, tolerations, GPU resources, ``/dev/shm``), reward, trainer (with a checkpoint volume);
* KEDA ScaledObjects scaling env, each pool and reward on their consumer groups' lag (reward to zero);
* Strimzi KafkaTopics for every topic and DLQ of the catalog (``topics/``);
* Redis and the Mooncake master and store (when ``deploy.redis`` / ``deploy.mooncake``);
* a PodMonitor scraping every pod's ``metrics`` port.

Pods run as a non-root user with a read-only root filesystem; writable paths are volumes. Probes hit
``/healthz`` and ``/readyz`` beside ``/metrics`` (see rollart.health).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollart.config import ConfigError, RollartConfig
from rollart.deploy.settings import StageDeployment
from rollart.topics import expand_catalog, load_catalog
from rollart.stages.registry import STAGES
from rollart.topics.access import job_access
from rollart.topics.catalog import TopicSpec

APP_USER = 10001
WORK_DIR = "/var/lib/rollart"
CONFIG_DIR = "/etc/rollart"
CHECKPOINT_DIR = f"{WORK_DIR}/checkpoints"
MOONCAKE_RPC_PORT, MOONCAKE_HTTP_PORT, MOONCAKE_METRICS_PORT, MOONCAKE_STORE_PORT = 50051, 8080, 9003, 50052
REDIS_PORT = 6379


def k8s_name(*parts: str) -> str:
    """A DNS-1123 label from free text (job names may hold ``_`` and capitals)."""
    name = re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")
    return re.sub(r"-{2,}", "-", name)[:63].rstrip("-")


@dataclass(frozen=True)
class Component:
    """One Deployment of the job: a stage member (or a service the stages need)."""

    name: str  # Deployment name
    stage: str  # a stage of rollart.stages.registry
    spec: StageDeployment
    args: tuple[str, ...]
    scale_groups: tuple[str, ...] = ()  # consumer groups whose lag scales it
    pool: str | None = None


class Renderer:
    def __init__(self, config: RollartConfig):
        self.config = config
        self.deploy = config.deploy
        self.namespace = self.deploy.namespace
        self.job = config.job
        self.catalog = load_catalog(config.topics)

    # -- names and labels ----------------------------------------------------------------------

    def name(self, *component: str) -> str:
        return k8s_name(self.job, *component)

    def labels(self, component: str, **extra: str) -> dict[str, str]:
        labels = {"app.kubernetes.io/name": "rollart", "app.kubernetes.io/instance": k8s_name(self.job),
                  "app.kubernetes.io/component": component, "app.kubernetes.io/part-of": "rollart",
                  "app.kubernetes.io/managed-by": "rollart"}
        labels.update({f"rollart.dev/{k}": v for k, v in extra.items()})
        return labels

    def selector(self, component: str, **extra: str) -> dict[str, str]:
        keep = ("app.kubernetes.io/instance", "app.kubernetes.io/component")
        labels = self.labels(component, **extra)
        return {k: v for k, v in labels.items() if k in keep or k.startswith("rollart.dev/")}

    def meta(self, name: str, component: str, **extra: str) -> dict[str, Any]:
        return {"name": name, "namespace": self.namespace, "labels": self.labels(component, **extra)}

    # -- endpoints -----------------------------------------------------------------------------

    def redis_url(self) -> str:
        if self.deploy.redis:
            return f"redis://{self.name('redis')}:{REDIS_PORT}/0"
        if not self.config.redis.url:
            raise ConfigError("deploy.redis is false, so redis.url must name the cluster's Redis")
        return self.config.redis.url

    def mooncake_endpoints(self) -> tuple[str, str] | None:
        if self.deploy.mooncake:
            host = self.name("mooncake-master")
            return f"{host}:{MOONCAKE_RPC_PORT}", f"http://{host}:{MOONCAKE_HTTP_PORT}/metadata"
        if self.config.mooncake.master and self.config.mooncake.metadata_server:
            return self.config.mooncake.master, self.config.mooncake.metadata_server
        return None

    def pod_config(self) -> dict[str, Any]:
        """The job config the pods load: the user's, with in-cluster endpoints and paths."""
        data = self.config.model_dump(mode="json", exclude={"deploy"}, exclude_none=True)
        data["kafka"].pop("sasl_password", None)  # from the Secret, as ROLLART_KAFKA_SASL_PASSWORD
        data["redis"].pop("password", None)  # likewise ROLLART_REDIS_PASSWORD
        data["kafka"]["bootstrap"] = self.deploy.kafka_bootstrap
        data["redis"]["url"] = self.redis_url()
        mooncake = self.mooncake_endpoints()
        if mooncake:
            data["mooncake"] = {"master": mooncake[0], "metadata_server": mooncake[1]}
        data["metrics"].update(port=self.deploy.metrics_port, host="0.0.0.0")
        data["trainer"]["checkpoint_dir"] = CHECKPOINT_DIR
        return data

    # -- components ----------------------------------------------------------------------------

    def components(self) -> list[Component]:
        """One Deployment per stage the job has (per pool for generation), from the stage registry."""
        out = []
        for stage in STAGES.values():
            for pool in stage.pools(self.config):
                # Kubernetes settings: deploy.<stage> (deploy.pools.<pool>); a stage without a section, defaults
                spec = self.config.pool_deployment(pool) if pool else getattr(self.deploy, stage.name, StageDeployment())
                resume = ("--resume",) if "resume" in stage.options else ()  # a restarted pod resumes
                out.append(Component(self.name(stage.label(), *([pool] if pool else [])), stage.name, spec,
                                     (*stage.command(pool), *resume), scale_groups=stage.scaling_groups(pool),
                                     pool=pool))
        return out

    def scaler_triggers(self, component: Component) -> list[tuple[str, str, TopicSpec]]:
        """(group, physical topic, spec) for every topic a scaling group of ``component`` consumes."""
        out = []
        for spec in self.catalog.values():
            logicals = [spec.name.format(pool=p) for p in self.config.pools] if spec.per_pool else [spec.name]
            pools = self.config.pools if spec.per_pool else [None]
            for logical, pool in zip(logicals, pools):
                groups = [g.format(pool=pool) if pool else g for g in spec.consumers]
                for group in groups:
                    if group in component.scale_groups:
                        out.append((group, f"{self.job}.{logical}", spec))
        return out

    # -- the whole job -------------------------------------------------------------------------

    def render(self) -> list[dict[str, Any]]:
        from rollart.deploy import objects

        docs: list[dict[str, Any]] = [objects.namespace(self), objects.service_account(self),
                                      objects.config_map(self)]
        if self.deploy.redis:
            docs += objects.redis(self)
        if self.deploy.mooncake:
            docs += objects.mooncake(self)
        docs.append(objects.checkpoint_claim(self))
        for component in self.components():
            docs.append(objects.stage_deployment(self, component))
            if component.stage == "trainer" and self.config.trainer.world_size > 1:
                docs += objects.trainer_ranks(self, component)
            if component.spec.autoscaling is not None:
                if STAGES[component.stage].single_writer:
                    raise ConfigError(f"deploy.{component.stage}.autoscaling: the {component.stage} is a single "
                                      "writer and cannot autoscale")
                docs.append(objects.scaled_object(self, component))
        if self.config.kafka.security_protocol != "PLAINTEXT":
            docs.append(objects.trigger_authentication(self))
        docs += [objects.kafka_topic(self, topic) for topic in expand_catalog(self.config, self.catalog)]
        if self.deploy.kafka_users:
            docs += [objects.kafka_user(self, access) for access in job_access(self.config)]
        docs.append(objects.pod_monitor(self))
        return docs


def render_job(config: RollartConfig) -> list[dict[str, Any]]:
    return Renderer(config).render()


def manifest_file(kind: str) -> str:
    return f"{re.sub(r'(?<!^)(?=[A-Z])', '-', kind).lower()}s.yaml"  # ScaledObject -> scaled-objects.yaml


def write_manifests(docs: list[dict[str, Any]], out: Path) -> list[Path]:
    """One YAML stream per kind plus a ``kustomization.yaml`` listing them (a Kustomize base:
    overlays patch images, replicas or node pools without re-rendering)."""
    import yaml

    out.mkdir(parents=True, exist_ok=True)
    by_file: dict[str, list[dict[str, Any]]] = {}
    for doc in docs:
        by_file.setdefault(manifest_file(doc["kind"]), []).append(doc)
    written = []
    for name, group in by_file.items():
        path = out / name
        path.write_text("# Rendered by `rollart deploy render`; edit the job config, not this file.\n"
                        + yaml.safe_dump_all(group, sort_keys=False))
        written.append(path)
    kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                     "resources": list(by_file)}
    (out / "kustomization.yaml").write_text(yaml.safe_dump(kustomization, sort_keys=False))
    return [*written, out / "kustomization.yaml"]


def read_manifests(directory: Path) -> list[dict[str, Any]]:
    """The objects of a rendered directory, in its kustomization's order."""
    import yaml

    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    return [doc for name in kustomization["resources"]
            for doc in yaml.safe_load_all((directory / name).read_text()) if doc]
