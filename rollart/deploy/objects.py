"""The Kubernetes objects of a rendered job, one builder per kind (see rollart.deploy.render)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import yaml

from rollart.deploy.render import (APP_USER, CHECKPOINT_DIR, CONFIG_DIR, MOONCAKE_HTTP_PORT, MOONCAKE_METRICS_PORT,
                                   MOONCAKE_RPC_PORT, MOONCAKE_STORE_PORT, REDIS_PORT, WORK_DIR, Component, k8s_name)
from rollart.stages.registry import STAGES
from rollart.training.ranks import RENDEZVOUS_PORT, WORKER_INDEX_ENV
from rollart.topics.access import StageAccess, stage_principal
from rollart.topics.catalog import PhysicalTopic

if TYPE_CHECKING:
    from rollart.deploy.render import Renderer

SASL_MODES = {"PLAIN": "plaintext", "SCRAM-SHA-256": "scram_sha256", "SCRAM-SHA-512": "scram_sha512"}


def namespace(r: "Renderer") -> dict:
    return {"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": r.namespace, "labels": {"app.kubernetes.io/part-of": "rollart"}}}


def service_account(r: "Renderer") -> dict:
    # Stages never call the Kubernetes API: no token in the pods.
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": r.meta(r.name("stages"), "stages"),
            "automountServiceAccountToken": False}


def config_map(r: "Renderer") -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": r.meta(r.name("config"), "config"),
            "data": {"config.yaml": yaml.safe_dump(r.pod_config(), sort_keys=False)}}


def checkpoint_claim(r: "Renderer") -> dict:
    spec: dict[str, Any] = {"accessModes": ["ReadWriteOnce"],
                            "resources": {"requests": {"storage": r.deploy.checkpoints_size}}}
    if r.deploy.storage_class:
        spec["storageClassName"] = r.deploy.storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": r.meta(r.name("checkpoints"), "trainer"),
            "spec": spec}


# -- pods ----------------------------------------------------------------------------------------

def pod_security(user: int = APP_USER) -> dict:
    return {"runAsNonRoot": True, "runAsUser": user, "runAsGroup": user, "fsGroup": user,
            "seccompProfile": {"type": "RuntimeDefault"}}


def container_security() -> dict:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}


def resources(spec) -> dict:
    requests = {"cpu": spec.cpu, "memory": spec.memory}
    limits: dict[str, Any] = {"memory": spec.memory}
    if spec.gpus:
        requests[spec.gpu_resource] = spec.gpus
        limits[spec.gpu_resource] = spec.gpus
    return {"requests": requests, "limits": limits}


def http_probe(path: str, period_s: int, failures: int, timeout_s: int = 5) -> dict:
    return {"httpGet": {"path": path, "port": "metrics"}, "periodSeconds": period_s,
            "failureThreshold": failures, "timeoutSeconds": timeout_s}


def stage_volumes(r: "Renderer", component: Component) -> tuple[list[dict], list[dict]]:
    volumes = [{"name": "config", "configMap": {"name": r.name("config")}},
               {"name": "work", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}]
    mounts = [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
              {"name": "work", "mountPath": WORK_DIR}, {"name": "tmp", "mountPath": "/tmp"}]
    if component.spec.shm:
        volumes.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": component.spec.shm}})
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    if r.deploy.models_pvc:
        volumes.append({"name": "models", "persistentVolumeClaim": {"claimName": r.deploy.models_pvc,
                                                                    "readOnly": True}})
        mounts.append({"name": "models", "mountPath": "/models", "readOnly": True})
    if component.stage == "trainer":
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": r.name("checkpoints")}})
        mounts.append({"name": "checkpoints", "mountPath": CHECKPOINT_DIR})
    return volumes, mounts


def stage_env(r: "Renderer") -> list[dict]:
    return [{"name": "ROLLART_HOME", "value": WORK_DIR}, {"name": "HOME", "value": WORK_DIR},
            {"name": "HF_HUB_OFFLINE", "value": "1"}, {"name": "PYTHONUNBUFFERED", "value": "1"},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "ROLLART_MEMBER", "value": "$(POD_NAME)"}]  # the transactional id's member part


def kafka_user_env(r: "Renderer", component: Component) -> list[dict]:
    """The stage's own Kafka login: its KafkaUser's name, and the password Strimzi's User Operator
    keeps in a Secret of the same name (set here, these win over the same keys in deploy.secret)."""
    if not r.deploy.kafka_users:
        return []
    principal = stage_principal(r.job, component.stage, component.pool)
    return [{"name": "ROLLART_KAFKA_SASL_USERNAME", "value": principal},
            {"name": "ROLLART_KAFKA_SASL_PASSWORD",
             "valueFrom": {"secretKeyRef": {"name": principal, "key": "password"}}}]


DIRECT_PORT = 5570  # the direct turn path's port in a pod when generation.direct_port is 0 ("any")


def direct_turns(r: "Renderer", component: Component) -> tuple[list[dict], list[dict]]:
    """A generation member's direct turn path (generation.transport: direct): it listens on every
    interface of its pod and advertises the pod's IP, which env pods reach without a Service (the
    pool registry tells them which pods are live). Its env and container port."""
    gen = r.config.generation
    if not STAGES[component.stage].runs_stage("generation") or gen.transport != "direct":
        return [], []
    port = gen.direct_port or DIRECT_PORT
    env = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           {"name": "ROLLART_GENERATION_DIRECT_BIND_HOST", "value": "0.0.0.0"},
           {"name": "ROLLART_GENERATION_DIRECT_ADVERTISE_HOST", "value": "$(POD_IP)"},
           {"name": "ROLLART_GENERATION_DIRECT_PORT", "value": str(port)}]
    return env, [{"name": "turns", "containerPort": port, "protocol": "TCP"}]


def stage_container(r: "Renderer", component: Component) -> dict:
    spec = component.spec
    _, mounts = stage_volumes(r, component)
    direct_env, direct_ports = direct_turns(r, component)
    container: dict[str, Any] = {
        "name": component.stage,
        "image": r.deploy.image, "imagePullPolicy": r.deploy.image_pull_policy,
        "command": ["rollart", "consume", *component.args, "--config", f"{CONFIG_DIR}/config.yaml"],
        "workingDir": WORK_DIR,
        "env": stage_env(r) + kafka_user_env(r, component) + (rank_env(r, 0) if _data_parallel(r, component) else [])
        + direct_env,
        "ports": [{"name": "metrics", "containerPort": r.deploy.metrics_port, "protocol": "TCP"}, *direct_ports],
        "resources": resources(spec),
        "securityContext": container_security(),
        "volumeMounts": mounts,
        # Startup: until the first poll (a model load can take minutes); liveness: every work loop
        # polled within metrics.liveness_stall_s; readiness: polling now.
        "startupProbe": http_probe("/readyz", 5, max(1, spec.startup_s // 5)),
        "livenessProbe": http_probe("/healthz", 10, 3),
        "readinessProbe": http_probe("/readyz", 5, 2),
    }
    if r.deploy.secret:
        container["envFrom"] = [{"secretRef": {"name": r.deploy.secret}}]
    return container


# -- the data-parallel trainer's ranks ----------------------------------------------------------------
# Rank 0 is the trainer Deployment (it consumes, checkpoints on its volume, publishes, serves /metrics);
# ranks 1..N-1 are a StatefulSet whose pod index gives each its rank. They meet at rank 0 through a
# headless Service that publishes rank 0 before it is ready (it is not ready until the ranks joined).

def _data_parallel(r: "Renderer", component: Component) -> bool:
    return component.stage == "trainer" and r.config.trainer.world_size > 1


def rank_env(r: "Renderer", rank: int | None) -> list[dict]:
    """torch.distributed's env:// names; ``rank`` None: a StatefulSet rank (its pod index + 1)."""
    env = [{"name": "WORLD_SIZE", "value": str(r.config.trainer.world_size)},
           {"name": "MASTER_ADDR", "value": r.name("trainer", "rdzv")},
           {"name": "MASTER_PORT", "value": str(RENDEZVOUS_PORT)}]
    if rank is not None:
        return [{"name": "RANK", "value": str(rank)}, *env]
    index = {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}
    return [{"name": WORKER_INDEX_ENV, "valueFrom": index}, *env]


def trainer_ranks(r: "Renderer", component: Component) -> list[dict]:
    """Ranks 1..N-1 and the rendezvous Service (rank 0's container gets RANK=0 in stage_container)."""
    name = r.name("trainer", "ranks")
    volumes, mounts = stage_volumes(r, component)
    volumes = [v for v in volumes if v["name"] != "checkpoints"]  # rank 0 alone checkpoints
    container = {**stage_container(r, component), "name": "trainer-rank", "volumeMounts":
                 [m for m in mounts if m["name"] != "checkpoints"], "env": stage_env(r) + rank_env(r, None),
                 "ports": [{"name": "rendezvous", "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"}]}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        container.pop(probe)  # no /metrics here: a rank that loses rank 0 exits, and restarts to rejoin
    pod = {**pod_spec(r, component), "containers": [container], "volumes": volumes}
    labels = r.labels("trainer-rank")
    ranks = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": r.meta(name, "trainer-rank"),
             "spec": {"replicas": r.config.trainer.world_size - 1, "serviceName": name,
                      "podManagementPolicy": "Parallel",  # the ranks start together; none waits for another
                      "selector": {"matchLabels": r.selector("trainer-rank")},
                      "template": {"metadata": {"labels": labels}, "spec": pod}}}
    ports = [{"name": "rendezvous", "port": RENDEZVOUS_PORT, "targetPort": RENDEZVOUS_PORT, "protocol": "TCP"}]
    rendezvous = {"apiVersion": "v1", "kind": "Service", "metadata": r.meta(r.name("trainer", "rdzv"), "trainer"),
                  "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": r.selector("trainer"),
                           "ports": ports}}
    governing = {"apiVersion": "v1", "kind": "Service", "metadata": r.meta(name, "trainer-rank"),
                 "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                          "selector": r.selector("trainer-rank"), "ports": ports}}
    return [rendezvous, governing, ranks]


def grace_period_s(r: "Renderer") -> int:
    # SIGTERM: running groups get env.shutdown_grace_s, then the loop drains and commits (each bounded).
    bus = r.config.bus
    return int(r.config.env.shutdown_grace_s + bus.drain_timeout_s + bus.commit_timeout_s) + 15


def pod_spec(r: "Renderer", component: Component) -> dict:
    volumes, _ = stage_volumes(r, component)
    spec: dict[str, Any] = {
        "serviceAccountName": r.name("stages"), "automountServiceAccountToken": False,
        "securityContext": pod_security(), "terminationGracePeriodSeconds": grace_period_s(r),
        "containers": [stage_container(r, component)], "volumes": volumes,
    }
    if component.spec.node_selector:
        spec["nodeSelector"] = dict(component.spec.node_selector)
    if component.spec.tolerations:
        spec["tolerations"] = [t.model_dump(exclude_none=True) for t in component.spec.tolerations]
    return spec


def deployment(r: "Renderer", name: str, component: str, pod: dict, *, replicas: int | None,
               strategy: dict, extra: dict[str, str], scrape: bool = True) -> dict:
    selector = r.selector(component, **extra)
    pod_labels = r.labels(component, **extra)
    if scrape:  # the PodMonitor scrapes pods with this label on their "metrics" port
        pod_labels["rollart.dev/scrape"] = "true"
    spec: dict[str, Any] = {"selector": {"matchLabels": selector}, "strategy": strategy,
                            "template": {"metadata": {"labels": pod_labels}, "spec": pod}}
    if replicas is not None:  # an autoscaled Deployment leaves replicas to KEDA's HPA
        spec["replicas"] = replicas
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": r.meta(name, component, **extra), "spec": spec}


def stage_deployment(r: "Renderer", component: Component) -> dict:
    spec = component.spec
    if STAGES[component.stage].single_writer:
        strategy = {"type": "Recreate"}  # one writer: never two at once
    elif spec.gpus:
        strategy = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}  # no spare GPUs
    else:
        strategy = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": 0}}
    extra = {"pool": k8s_name(component.pool)} if component.pool else {}
    replicas = None if spec.autoscaling is not None else spec.replicas
    return deployment(r, component.name, component.stage, pod_spec(r, component), replicas=replicas,
                      strategy=strategy, extra=extra)


# -- autoscaling ---------------------------------------------------------------------------------

def kafka_trigger(r: "Renderer", group: str, topic: str, autoscaling) -> dict:
    metadata = {"bootstrapServers": r.deploy.kafka_bootstrap, "consumerGroup": f"{r.job}.{group}", "topic": topic,
                "lagThreshold": str(autoscaling.lag_threshold),
                "activationLagThreshold": str(autoscaling.activation_lag_threshold),
                "offsetResetPolicy": "earliest",  # our consumers start at the earliest offset
                "allowIdleConsumers": "false"}  # never more replicas than partitions
    trigger: dict[str, Any] = {"type": "kafka", "name": k8s_name(topic[len(r.job) + 1:]), "metadata": metadata}
    kafka = r.config.kafka
    if kafka.security_protocol != "PLAINTEXT":
        if kafka.sasl_mechanism:
            metadata["sasl"] = SASL_MODES[kafka.sasl_mechanism]
        if kafka.security_protocol in ("SSL", "SASL_SSL"):
            metadata["tls"] = "enable"
        trigger["authenticationRef"] = {"name": r.name("kafka-auth")}
    return trigger


def running_requests_trigger(r: "Renderer", component: Component) -> list[dict]:
    """A generation pool on the direct turn path scales on its requests in flight (Prometheus: the
    members' ``rollart_generation_running_requests``), a replica per 3/4 of ``max_concurrency``; its
    gen.requests lag only counts the turns that fell back to the bus."""
    if component.stage != "generation" or r.config.generation.transport != "direct":
        return []
    if not r.deploy.prometheus_url:
        from rollart.config import ConfigError

        raise ConfigError(f"deploy.prometheus_url must be set to autoscale pool {component.pool!r} under "
                          "generation.transport: direct (its turns make no gen.requests lag; KEDA asks Prometheus "
                          "for the pool's running requests instead)")
    query = f'sum(rollart_generation_running_requests{{job="{r.job}",pool="{component.pool}"}})'
    return [{"type": "prometheus", "name": "running-requests",
             "metadata": {"serverAddress": r.deploy.prometheus_url, "query": query,
                          "threshold": str(max(1, r.config.generation.max_concurrency * 3 // 4)),
                          "activationThreshold": "0"}}]


def scaled_object(r: "Renderer", component: Component) -> dict:
    scaling = component.spec.autoscaling
    triggers = r.scaler_triggers(component)
    partitions = max(spec.partitions for _, _, spec in triggers)
    spec = {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": component.name},
        "minReplicaCount": scaling.min_replicas,
        "maxReplicaCount": min(scaling.max_replicas, partitions),  # a replica without a partition idles
        "pollingInterval": scaling.polling_interval_s,
        "cooldownPeriod": scaling.cooldown_s,
        "triggers": [kafka_trigger(r, group, topic, scaling) for group, topic, _ in triggers]
        + running_requests_trigger(r, component),
    }
    extra = {"pool": k8s_name(component.pool)} if component.pool else {}
    return {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
            "metadata": r.meta(component.name, component.stage, **extra), "spec": spec}


def trigger_authentication(r: "Renderer") -> dict:
    if not r.deploy.secret:
        from rollart.config import ConfigError

        raise ConfigError("deploy.secret must name the Secret with the Kafka credentials "
                          f"(kafka.security_protocol is {r.config.kafka.security_protocol})")
    keys = {"username": "ROLLART_KAFKA_SASL_USERNAME", "password": "ROLLART_KAFKA_SASL_PASSWORD",
            "ca": "KAFKA_CA_CRT", "cert": "KAFKA_TLS_CRT", "key": "KAFKA_TLS_KEY"}
    if not r.config.kafka.sasl_mechanism:
        keys = {k: v for k, v in keys.items() if k not in ("username", "password")}
    refs = [{"parameter": param, "name": r.deploy.secret, "key": key} for param, key in keys.items()]
    return {"apiVersion": "keda.sh/v1alpha1", "kind": "TriggerAuthentication",
            "metadata": r.meta(r.name("kafka-auth"), "autoscaling"), "spec": {"secretTargetRef": refs}}


# -- topics and monitoring -----------------------------------------------------------------------

def kafka_topic(r: "Renderer", topic: PhysicalTopic) -> dict:
    configs = dict(topic.configs)  # max.message.bytes included: bus.max_value_bytes plus overhead
    return {"apiVersion": "kafka.strimzi.io/v1beta2", "kind": "KafkaTopic",
            "metadata": {"name": k8s_name(topic.name.replace(".", "-")), "namespace": r.namespace,
                         "labels": {**r.labels("topics"), "strimzi.io/cluster": r.deploy.kafka_cluster}},
            "spec": {"topicName": topic.name, "partitions": topic.partitions,
                     "replicas": r.config.kafka.replication_factor, "config": configs}}


def kafka_user(r: "Renderer", access: StageAccess) -> dict:
    """A Strimzi KafkaUser for one stage: SCRAM-SHA-512 and exactly the stage's ACLs."""
    def rule(kind: str, name: str, operations: list[str]) -> dict:
        return {"resource": {"type": kind, "name": name, "patternType": "literal"}, "operations": operations,
                "host": "*"}

    acls = [rule("topic", t, ["Read", "Describe"]) for t in access.read if t not in access.write]
    acls += [rule("topic", t, ["Read", "Write", "Describe"] if t in access.read else ["Write", "Describe"])
             for t in access.write]
    acls += [rule("group", g, ["Read"]) for g in access.groups]
    return {"apiVersion": "kafka.strimzi.io/v1beta2", "kind": "KafkaUser",
            "metadata": {"name": access.principal, "namespace": r.namespace,
                         "labels": {**r.labels(access.stage), "strimzi.io/cluster": r.deploy.kafka_cluster}},
            "spec": {"authentication": {"type": "scram-sha-512"},
                     "authorization": {"type": "simple", "acls": acls}}}


def pod_monitor(r: "Renderer") -> dict:
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
            "metadata": r.meta(r.name("pods"), "monitoring"),
            "spec": {"selector": {"matchLabels": {"app.kubernetes.io/instance": k8s_name(r.job),
                                                  "rollart.dev/scrape": "true"}},
                     # honorLabels: our series carry the rollart job as `job`; Prometheus would
                     # otherwise rename it exported_job and the dashboards' {job="$job"} would match nothing
                     "podMetricsEndpoints": [{"port": "metrics", "path": "/metrics", "honorLabels": True,
                                              "interval": f"{r.deploy.scrape_interval_s}s"}]}}


# -- services the stages need --------------------------------------------------------------------

def service(r: "Renderer", name: str, component: str, ports: dict[str, int]) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": r.meta(name, component),
            "spec": {"selector": r.selector(component),
                     "ports": [{"name": n, "port": p, "targetPort": n, "protocol": "TCP"} for n, p in ports.items()]}}


def redis(r: "Renderer") -> list[dict]:
    # A cache only (every counter rebuilds from the topics): no persistence, no volume to lose.
    name = r.name("redis")
    container = {"name": "redis", "image": r.deploy.redis_image, "imagePullPolicy": r.deploy.image_pull_policy,
                 "args": ["--save", "", "--appendonly", "no", "--port", str(REDIS_PORT)],
                 "ports": [{"name": "redis", "containerPort": REDIS_PORT}],
                 "resources": {"requests": {"cpu": "500m", "memory": "2Gi"}, "limits": {"memory": "2Gi"}},
                 "securityContext": container_security(),
                 "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                 "readinessProbe": {"exec": {"command": ["redis-cli", "ping"]}, "periodSeconds": 5},
                 "livenessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 10, "failureThreshold": 3}}
    pod = {"securityContext": pod_security(999), "automountServiceAccountToken": False,
           "containers": [container], "volumes": [{"name": "data", "emptyDir": {}}]}
    return [deployment(r, name, "redis", pod, replicas=1, strategy={"type": "Recreate"}, extra={}, scrape=False),
            service(r, name, "redis", {"redis": REDIS_PORT})]


def mooncake(r: "Renderer") -> list[dict]:
    master, store = r.name("mooncake-master"), r.name("mooncake-store")
    master_args = [f"-rpc_port={MOONCAKE_RPC_PORT}", "-rpc_address=0.0.0.0", "-enable_http_metadata_server=true",
                   "-http_metadata_server_host=0.0.0.0", f"-http_metadata_server_port={MOONCAKE_HTTP_PORT}",
                   f"-metrics_port={MOONCAKE_METRICS_PORT}"]
    master_c = _service_container(r, "mooncake-master", ["mooncake_master", *master_args],
                                  {"rpc": MOONCAKE_RPC_PORT, "http": MOONCAKE_HTTP_PORT, "metrics": MOONCAKE_METRICS_PORT},
                                  cpu="1", memory="2Gi")
    segment_gib = max(1, r.deploy.mooncake_store_bytes >> 30)
    store_args = [f"-master_server_address={master}:{MOONCAKE_RPC_PORT}",
                  f"-metadata_server=http://{master}:{MOONCAKE_HTTP_PORT}/metadata",
                  f"-global_segment_size={r.deploy.mooncake_store_bytes}", "-local_buffer_size=16 MB",
                  "-host=$(POD_IP)", f"-port={MOONCAKE_STORE_PORT}", "-protocol=tcp"]
    store_c = _service_container(r, "mooncake-store", ["mooncake_client", *store_args],
                                 {"store": MOONCAKE_STORE_PORT}, cpu="2", memory=f"{segment_gib + 2}Gi")
    store_c["env"] = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    docs = []
    for name, component, container in ((master, "mooncake-master", master_c), (store, "mooncake-store", store_c)):
        pod = {"securityContext": pod_security(), "automountServiceAccountToken": False, "containers": [container],
               "volumes": [{"name": "tmp", "emptyDir": {}}]}
        docs.append(deployment(r, name, component, pod, replicas=1, strategy={"type": "Recreate"}, extra={},
                               scrape=component == "mooncake-master"))  # the master serves metrics
    docs.append(service(r, master, "mooncake-master", {"rpc": MOONCAKE_RPC_PORT, "http": MOONCAKE_HTTP_PORT}))
    return docs


def _service_container(r: "Renderer", name: str, command: list[str], ports: dict[str, int], *, cpu: str,
                       memory: str) -> dict:
    first = next(iter(ports))
    return {"name": name, "image": r.deploy.image, "imagePullPolicy": r.deploy.image_pull_policy, "command": command,
            "ports": [{"name": n, "containerPort": p} for n, p in ports.items()],
            "resources": {"requests": {"cpu": cpu, "memory": memory}, "limits": {"memory": memory}},
            "securityContext": container_security(), "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
            "readinessProbe": {"tcpSocket": {"port": first}, "periodSeconds": 5},
            "livenessProbe": {"tcpSocket": {"port": first}, "periodSeconds": 10, "failureThreshold": 3}}
