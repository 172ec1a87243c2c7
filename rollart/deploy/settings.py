"""The Kubernetes settings of a job (``deploy:`` in its config, ``RollartConfig.deploy``): what
``rollart deploy render`` makes of it is in :mod:`rollart.deploy.render`.

Validated with the rest of the config (rollart.config imports this module), so it imports nothing of
rollart but the shared section base: the deploy package's renderer sits above the stages.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from rollart.section import Section


class Toleration(Section):
    key: str | None = None
    operator: Literal["Exists", "Equal"] = "Exists"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None


class Autoscaling(Section):
    """A KEDA ScaledObject on the group's lag (summed over its topics' partitions)."""

    min_replicas: int = Field(default=1, ge=0)  # 0: scale to zero while there is no lag
    max_replicas: int = Field(default=8, ge=1)  # more than the topic's partitions would sit idle
    lag_threshold: int = Field(default=16, ge=1)  # target lag per replica
    activation_lag_threshold: int = Field(default=0, ge=0)  # lag that wakes a group scaled to zero
    polling_interval_s: int = Field(default=15, ge=1)
    cooldown_s: int = Field(default=300, ge=0)  # before scaling to zero

    @model_validator(mode="after")
    def _bounds(self) -> "Autoscaling":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} > max_replicas {self.max_replicas}")
        return self


class StageDeployment(Section):
    """Where and how big one consumer group's pods are (its hardware class)."""

    replicas: int = Field(default=1, ge=0)  # without autoscaling
    autoscaling: Autoscaling | None = None
    cpu: str = "1"
    memory: str = "2Gi"
    gpus: int = Field(default=0, ge=0)
    gpu_resource: str = "nvidia.com/gpu"
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    # Until the first poll (loading a model can take many minutes); None: 30 min with GPUs, else 5 min.
    startup_timeout_s: int | None = Field(default=None, ge=10)
    shm: str | None = None  # size of a memory-backed /dev/shm (NCCL, vLLM workers)

    @property
    def startup_s(self) -> int:
        return self.startup_timeout_s or (1800 if self.gpus else 300)


def gpu_stage(**kw: Any) -> StageDeployment:
    return StageDeployment(gpus=1, cpu="8", memory="64Gi", shm="16Gi", **kw)


class DeployConfig(Section):
    """Kubernetes rendering of the job (``rollart deploy render``)."""

    namespace: str = Field(default="rollart", pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)
    image: str = "ghcr.io/rollart/rollart:0.1.0"
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    kafka_cluster: str = "rollart"  # the Strimzi Kafka resource the KafkaTopics belong to
    kafka_bootstrap: str = "rollart-kafka-bootstrap:9092"
    secret: str | None = None  # a Secret whose keys become env vars (ROLLART_KAFKA_SASL_PASSWORD, ...)
    # One Strimzi KafkaUser per stage (SCRAM-SHA-512, the ACLs rollart.topics.access derives from the
    # catalog); each stage's pods log in as theirs, the password from the Secret Strimzi writes for it.
    kafka_users: bool = False
    redis: bool = True  # deploy a Redis (a cache: every counter rebuilds from the topics); False: redis.url
    redis_image: str = "redis:7.2-alpine"
    mooncake: bool = True  # deploy a Mooncake master and store for weight buckets
    mooncake_store_bytes: int = Field(default=8 << 30, ge=1 << 20)
    models_pvc: str | None = None  # a PersistentVolumeClaim holding model.path, mounted read-only
    checkpoints_size: str = "100Gi"  # the trainer's checkpoint volume
    storage_class: str | None = None
    metrics_port: int = Field(default=9400, ge=1024, le=65535)
    scrape_interval_s: int = Field(default=15, ge=1)
    # The Prometheus KEDA asks for a generation pool's running requests: under generation.transport:
    # direct, turns make no gen.requests lag to scale on (e.g. http://prometheus-operated.monitoring:9090)
    prometheus_url: str | None = None
    feeder: StageDeployment = StageDeployment(cpu="500m", memory="1Gi")
    env: StageDeployment = StageDeployment(cpu="4", memory="8Gi", autoscaling=Autoscaling(max_replicas=16))
    reward: StageDeployment = StageDeployment(autoscaling=Autoscaling(min_replicas=0, max_replicas=8,
                                                                      lag_threshold=32, cooldown_s=120))
    trainer: StageDeployment = gpu_stage()
    eval: StageDeployment = StageDeployment(cpu="500m", memory="1Gi")  # the eval stage (its pool is under pools)
    pools: dict[str, StageDeployment] = Field(default_factory=dict)  # generation pools; unset: one GPU each
