"""`rollart deploy render`: a two-pool job's manifests validate and say what the job config says."""

from __future__ import annotations

import subprocess
import sys

import jsonschema
import kubernetes_validate
import pytest
import yaml

from rollart.config import ConfigError, build_config, load_config
from rollart.deploy import read_manifests, render_job
from rollart.stages import prepare_config
from rollart.topics import expand_catalog
from tests.conftest import REPO
from tests.deploy.operator_schemas import SCHEMAS

EXAMPLE = REPO / "deploy" / "examples" / "two-pool.yaml"
K8S_VERSION = "1.30.0"  # the oldest Kubernetes we support (sidecar-free, probes by port name)


@pytest.fixture(scope="module")
def config():
    return prepare_config(load_config(EXAMPLE))


@pytest.fixture(scope="module")
def docs(config):
    return render_job(config)


def by_kind(docs, kind):
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def pod(deployment):
    return deployment["spec"]["template"]["spec"]


def test_every_object_validates_against_its_schema(docs):
    for doc in docs:
        if doc["kind"] in SCHEMAS:
            jsonschema.validate(doc, SCHEMAS[doc["kind"]])
        else:  # the built-in kinds, against the Kubernetes API's own OpenAPI schemas, unknown fields rejected
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    assert {d["kind"] for d in docs} >= {"Deployment", "ScaledObject", "KafkaTopic", "PodMonitor", "ConfigMap",
                                         "Service", "PersistentVolumeClaim", "Namespace", "ServiceAccount"}


def test_schemas_reject_what_the_operators_would(docs):
    """The operator schemas bite: a ScaledObject without a target and a KafkaTopic without its cluster label."""
    scaled = next(d for d in docs if d["kind"] == "ScaledObject")
    broken = yaml.safe_load(yaml.safe_dump(scaled))
    del broken["spec"]["scaleTargetRef"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, SCHEMAS["ScaledObject"])
    topic = yaml.safe_load(yaml.safe_dump(next(d for d in docs if d["kind"] == "KafkaTopic")))
    del topic["metadata"]["labels"]["strimzi.io/cluster"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(topic, SCHEMAS["KafkaTopic"])
    deployment = yaml.safe_load(yaml.safe_dump(next(d for d in docs if d["kind"] == "Deployment")))
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGett"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def test_generation_pools_get_their_hardware_class(docs):
    deployments = by_kind(docs, "Deployment")
    h800, h20 = pod(deployments["agentic-two-pool-gen-h800"]), pod(deployments["agentic-two-pool-gen-h20"])
    assert h800["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H800"}
    assert h20["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H20"}
    assert {"key": "pool", "operator": "Equal", "value": "h20", "effect": "NoSchedule"} in h20["tolerations"]
    for spec, pool in ((h800, "h800"), (h20, "h20")):
        container = spec["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert container["command"][:5] == ["rollart", "consume", "generation", "--pool", pool]
        assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    env, trainer = pod(deployments["agentic-two-pool-env"]), pod(deployments["agentic-two-pool-trainer"])
    assert env["nodeSelector"] == {"rollart.dev/node-class": "cpu"}
    assert "nvidia.com/gpu" not in env["containers"][0]["resources"]["requests"]
    assert trainer["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] == 8
    assert deployments["agentic-two-pool-trainer"]["spec"]["strategy"] == {"type": "Recreate"}
    assert deployments["agentic-two-pool-trainer"]["spec"]["replicas"] == 1
    claims = [v["persistentVolumeClaim"]["claimName"] for v in trainer["volumes"] if "persistentVolumeClaim" in v]
    assert "agentic-two-pool-checkpoints" in claims and "models" in claims


def test_scalers_target_each_groups_lag(docs, config):
    scaled = by_kind(docs, "ScaledObject")
    deployments = by_kind(docs, "Deployment")
    assert set(scaled) == {"agentic-two-pool-env", "agentic-two-pool-gen-h800", "agentic-two-pool-gen-h20",
                           "agentic-two-pool-reward"}
    for name, obj in scaled.items():
        assert obj["spec"]["scaleTargetRef"]["name"] == name and name in deployments
        assert "replicas" not in deployments[name]["spec"], "KEDA's HPA owns replicas of autoscaled Deployments"
    triggers = {n: [(t["metadata"]["consumerGroup"], t["metadata"]["topic"]) for t in o["spec"]["triggers"]]
                for n, o in scaled.items()}
    assert triggers["agentic-two-pool-gen-h20"] == [("agentic-two-pool.gen-h20", "agentic-two-pool.gen.requests.h20")]
    assert triggers["agentic-two-pool-env"] == [("agentic-two-pool.env", "agentic-two-pool.tasks")]
    assert ("agentic-two-pool.reward", "agentic-two-pool.trajectories.completed") in triggers["agentic-two-pool-reward"]
    reward = scaled["agentic-two-pool-reward"]["spec"]
    assert reward["minReplicaCount"] == 0 and reward["triggers"][0]["metadata"]["activationLagThreshold"] == "1"
    assert scaled["agentic-two-pool-gen-h800"]["spec"]["minReplicaCount"] == 2
    assert scaled["agentic-two-pool-gen-h800"]["spec"]["triggers"][0]["metadata"]["lagThreshold"] == "32"
    # no more replicas than partitions: the 16-replica request is capped by gen.requests' 16, env's 8 stays
    assert scaled["agentic-two-pool-gen-h800"]["spec"]["maxReplicaCount"] == 16
    assert scaled["agentic-two-pool-env"]["spec"]["maxReplicaCount"] == 8


def test_kafka_topics_come_from_the_catalog(docs, config):
    topics = {d["spec"]["topicName"]: d for d in docs if d["kind"] == "KafkaTopic"}
    expected = {t.name: t for t in expand_catalog(config)}
    assert set(topics) == set(expected)
    for name, topic in topics.items():
        assert topic["metadata"]["labels"]["strimzi.io/cluster"] == "rl-kafka"
        assert topic["spec"]["partitions"] == expected[name].partitions
        assert topic["spec"]["config"]["retention.ms"] == expected[name].configs["retention.ms"]
        assert topic["spec"]["replicas"] == 3
    assert "agentic-two-pool.gen.requests.h20.dlq" in topics


def test_pods_are_locked_down_and_probed(docs):
    monitor = next(d for d in docs if d["kind"] == "PodMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    for name, deployment in by_kind(docs, "Deployment").items():
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
        spec = pod(deployment)
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["automountServiceAccountToken"] is False
        for container in spec["containers"]:
            security = container["securityContext"]
            assert security["readOnlyRootFilesystem"] and not security["allowPrivilegeEscalation"]
            assert security["capabilities"] == {"drop": ["ALL"]}
            assert "livenessProbe" in container and "readinessProbe" in container
        if "rollart consume" in " ".join(spec["containers"][0].get("command", [])):
            container = spec["containers"][0]
            assert selector.items() <= labels.items(), f"{name} is not scraped"
            assert [p["name"] for p in container["ports"]] == ["metrics"]
            assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
            assert container["startupProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    generation = pod(by_kind(docs, "Deployment")["agentic-two-pool-gen-h20"])["containers"][0]
    assert generation["startupProbe"]["periodSeconds"] * generation["startupProbe"]["failureThreshold"] >= 1800


def test_pods_load_the_config_they_are_given(docs):
    """The ConfigMap is a valid job config pointing at the in-cluster services."""
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    pod_config = build_config(yaml.safe_load(config_map["data"]["config.yaml"]))
    assert pod_config.kafka.bootstrap == "rl-kafka-kafka-bootstrap.kafka:9092"
    assert pod_config.redis.url == "redis://agentic-two-pool-redis:6379/0"
    assert pod_config.mooncake.master == "agentic-two-pool-mooncake-master:50051"
    assert pod_config.metrics.port == 9400 and pod_config.tags["math"].pool == "h20"
    services = by_kind(docs, "Service")
    assert {p["port"] for p in services["agentic-two-pool-mooncake-master"]["spec"]["ports"]} == {50051, 8080}


def test_bad_deploy_config_fails_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"deploy.pools \['h100'\]"):
        build_config({"pools": ["a"], "deploy": {"pools": {"h100": {}}}})
    with pytest.raises(ConfigError, match="deploy.trainer.autoscaling"):
        render_job(build_config({"deploy": {"trainer": {"autoscaling": {}}}}))
    with pytest.raises(ConfigError, match="min_replicas 3 > max_replicas 2"):
        build_config({"deploy": {"env": {"autoscaling": {"min_replicas": 3, "max_replicas": 2}}}})
    sasl = {"kafka": {"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512", "sasl_password": "pw1"},
            "redis": {"url": "rediss://redis:6380/0", "password": "pw2"}}
    with pytest.raises(ConfigError, match="deploy.secret"):
        render_job(build_config(sasl))
    docs = render_job(build_config({**sasl, "deploy": {"secret": "kafka-creds"}}))
    auth = next(d for d in docs if d["kind"] == "TriggerAuthentication")
    jsonschema.validate(auth, SCHEMAS["TriggerAuthentication"])
    for obj in (d for d in docs if d["kind"] == "ScaledObject"):
        trigger = obj["spec"]["triggers"][0]
        assert trigger["authenticationRef"] == {"name": auth["metadata"]["name"]}
        assert (trigger["metadata"]["sasl"], trigger["metadata"]["tls"]) == ("scram_sha512", "enable")
    stage = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-env"))
    assert pod(stage)["containers"][0]["envFrom"] == [{"secretRef": {"name": "kafka-creds"}}]
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    pod_yaml = config_map["data"]["config.yaml"]
    assert "sasl_password" not in pod_yaml and "pw1" not in pod_yaml and "pw2" not in pod_yaml  # from the Secret


def test_kafka_users_carry_each_stages_acls_and_pods_log_in_as_them(config):
    from rollart.topics.access import job_access

    secured = config.model_copy(update={
        "kafka": config.kafka.model_copy(update={"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512"}),
        "deploy": config.deploy.model_copy(update={"kafka_users": True, "secret": "kafka-ca"})})
    docs = render_job(secured)
    users = by_kind(docs, "KafkaUser")
    accesses = {a.principal: a for a in job_access(secured)}
    assert set(users) == set(accesses) and len(users) == 4 + len(secured.pools)
    for name, user in users.items():
        jsonschema.validate(user, SCHEMAS["KafkaUser"])
        access = accesses[name]
        granted = {(rule["resource"]["type"], rule["resource"]["name"], op)
                   for rule in user["spec"]["authorization"]["acls"] for op in rule["operations"]}
        wanted = ({("topic", t, op) for t in access.read for op in ("Read", "Describe")}
                  | {("topic", t, op) for t in access.write for op in ("Write", "Describe")}
                  | {("group", g, "Read") for g in access.groups})
        assert granted == wanted, name
    for deployment in by_kind(docs, "Deployment").values():
        container = pod(deployment)["containers"][0]
        if container.get("command", [])[:2] != ["rollart", "consume"]:
            continue  # Redis, Mooncake
        stage, pool = container["command"][2], None
        if stage == "generation":
            pool = container["command"][container["command"].index("--pool") + 1]
        principal = next(a.principal for a in accesses.values() if (a.stage, a.pool) == (stage, pool))
        env = {e["name"]: e for e in container["env"]}
        assert env["ROLLART_KAFKA_SASL_USERNAME"]["value"] == principal
        assert env["ROLLART_KAFKA_SASL_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": principal, "key": "password"}
    with pytest.raises(ConfigError, match="deploy.kafka_users"):
        build_config({"deploy": {"kafka_users": True}})


def test_an_eval_section_adds_the_eval_stage_its_pool_and_topics():
    data = yaml.safe_load(EXAMPLE.read_text())
    data["pools"] = [*data["pools"], "eval"]
    data["tags"]["frozenlake-heldout"] = {"env": "frozenlake", "weight": 0}
    data["eval"] = {"tags": ["frozenlake-heldout"], "pool": "eval", "every_versions": 5}
    data["kafka"].update(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512")
    data["deploy"].update(kafka_users=True, secret="kafka-ca")
    docs = render_job(prepare_config(build_config(data, "eval example")))
    deployments = by_kind(docs, "Deployment")
    stage = deployments["agentic-two-pool-eval"]
    assert pod(stage)["containers"][0]["command"][:3] == ["rollart", "consume", "eval"]
    assert stage["spec"]["strategy"] == {"type": "Recreate"}, "a single writer: never two members at once"
    assert "agentic-two-pool-gen-eval" in deployments, "the eval pool is a generation pool of its own"
    topics = {d["spec"]["topicName"] for d in by_kind(docs, "KafkaTopic").values()}
    assert {"agentic-two-pool.eval.results", "agentic-two-pool.eval.summaries"} <= topics
    acls = by_kind(docs, "KafkaUser")["agentic-two-pool-eval"]["spec"]["authorization"]["acls"]
    writes = {a["resource"]["name"] for a in acls if "Write" in a["operations"]}
    assert writes == {"agentic-two-pool.tasks", "agentic-two-pool.eval.summaries", "agentic-two-pool.eval.results.dlq"}


def test_a_data_parallel_trainer_renders_its_ranks_and_their_rendezvous(monkeypatch):
    """trainer.world_size 3: rank 0 is the trainer Deployment (RANK=0, its checkpoint volume), ranks 1
    and 2 a StatefulSet whose pod index names the rank; all meet at a headless Service of rank 0
    that is published before rank 0 is ready (it is not ready until the ranks have joined)."""
    from rollart.training.ranks import Rendezvous

    data = yaml.safe_load(EXAMPLE.read_text())
    data["trainer"] = {**data.get("trainer", {}), "world_size": 3, "backend": "torch"}
    docs = render_job(prepare_config(build_config(data, "data-parallel example")))
    for doc in docs:
        if doc["kind"] not in SCHEMAS:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    rank0 = pod(by_kind(docs, "Deployment")["agentic-two-pool-trainer"])["containers"][0]
    ranks = by_kind(docs, "StatefulSet")["agentic-two-pool-trainer-ranks"]
    worker = pod(ranks)["containers"][0]
    rdzv = by_kind(docs, "Service")["agentic-two-pool-trainer-rdzv"]
    assert ranks["spec"]["replicas"] == 2 and ranks["spec"]["podManagementPolicy"] == "Parallel"
    assert worker["command"] == rank0["command"], "every rank runs `rollart consume trainer`"
    assert "checkpoints" not in {m["name"] for m in worker["volumeMounts"]}, "rank 0 alone checkpoints"
    assert "checkpoints" in {m["name"] for m in rank0["volumeMounts"]}
    assert rdzv["spec"]["clusterIP"] == "None" and rdzv["spec"]["publishNotReadyAddresses"] is True
    assert rdzv["spec"]["selector"] == by_kind(docs, "Deployment")["agentic-two-pool-trainer"]["spec"]["selector"][
        "matchLabels"], "the rendezvous address is rank 0's pod"
    assert not any(d["spec"]["scaleTargetRef"]["name"].startswith("agentic-two-pool-trainer")
                   for d in by_kind(docs, "ScaledObject").values()), "ranks are never autoscaled"

    def rank_of(container, pod_index: str | None = None):
        for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TRAINER_WORKER_INDEX"):
            monkeypatch.delenv(var, raising=False)
        for var in container["env"]:
            if var["name"] in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
                monkeypatch.setenv(var["name"], var["value"])
            elif "pod-index" in str(var.get("valueFrom")):
                monkeypatch.setenv(var["name"], pod_index)  # what the downward API gives pod <name>-<index>
        return Rendezvous.from_env(3)

    assert rank_of(rank0) == Rendezvous(0, 3, "agentic-two-pool-trainer-rdzv", 29500)
    assert [rank_of(worker, i).rank for i in ("0", "1")] == [1, 2]
    assert rank_of(worker, "1").addr == "agentic-two-pool-trainer-rdzv"
    data["trainer"]["world_size"] = 1
    assert "StatefulSet" not in {d["kind"] for d in render_job(prepare_config(build_config(data, "one rank")))}


def test_cli_writes_a_kustomize_base_and_the_committed_example_is_current(tmp_path):
    out = tmp_path / "rendered"
    result = subprocess.run([sys.executable, "-m", "rollart.cli", "deploy", "render", str(EXAMPLE), "--out", str(out)],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "36 objects" in result.stdout
    assert read_manifests(out) == read_manifests(REPO / "deploy" / "examples" / "two-pool"), \
        "deploy/examples/two-pool is stale: rerun `rollart deploy render deploy/examples/two-pool.yaml " \
        "--out deploy/examples/two-pool`"
    bad = tmp_path / "bad.yaml"
    bad.write_text("pools: [a]\ndeploy: {pools: {b: {gpus: 1}}}\n")
    result = subprocess.run([sys.executable, "-m", "rollart.cli", "deploy", "render", str(bad), "--out", str(out)],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "deploy.pools" in result.stderr


def test_direct_turns_listen_on_the_pod_and_advertise_its_ip(monkeypatch):
    data = yaml.safe_load(EXAMPLE.read_text())
    data["generation"] = {**data.get("generation", {}), "transport": "direct"}
    with pytest.raises(ConfigError, match="deploy.prometheus_url"):  # autoscaled pools, nothing to scale on
        render_job(prepare_config(build_config(data, "direct example")))
    data["deploy"]["prometheus_url"] = "http://prometheus-operated.monitoring:9090"
    docs = render_job(prepare_config(build_config(data, "direct example")))
    deployments = by_kind(docs, "Deployment")
    triggers = by_kind(docs, "ScaledObject")["agentic-two-pool-gen-h20"]["spec"]["triggers"]
    running = [t for t in triggers if t["type"] == "prometheus"]
    assert [t["metadata"]["query"] for t in running] == \
        ['sum(rollart_generation_running_requests{job="agentic-two-pool",pool="h20"})']
    assert [t for t in triggers if t["type"] == "kafka"], "the fallback's lag still counts"
    assert not [t for t in by_kind(docs, "ScaledObject")["agentic-two-pool-env"]["spec"]["triggers"]
                if t["type"] == "prometheus"]
    for doc in docs:
        if doc["kind"] == "ScaledObject":
            jsonschema.validate(doc, SCHEMAS["ScaledObject"])
        elif doc["kind"] == "Deployment":
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    container = pod(deployments["agentic-two-pool-gen-h800"])["containers"][0]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert {"name": "turns", "containerPort": int(env["ROLLART_GENERATION_DIRECT_PORT"]), "protocol": "TCP"} \
        in container["ports"]
    assert "ROLLART_GENERATION_DIRECT_PORT" not in {e["name"] for e in pod(deployments["agentic-two-pool-env"])
                                                   ["containers"][0]["env"]}
    # the variables are the config's fields: the member binds every interface and advertises the pod
    for name, value in env.items():
        if name.startswith("ROLLART_GENERATION_DIRECT_"):
            monkeypatch.setenv(name, value.replace("$(POD_IP)", "10.0.0.7"))
    generation = build_config(data, "inside the pod").generation
    assert (generation.direct_bind_host, generation.direct_advertise_host, generation.direct_port) == \
        ("0.0.0.0", "10.0.0.7", 5570)
