"""`rollart deploy apply` and `status` against an API server, with lag from the real broker.

No Kubernetes API server runs on these machines, so the API side is tests/deploy/fake_apiserver.py
(it checks what the real one would reject: not a server-side apply, no field manager, wrong URL).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import yaml

from rollart.deploy import render_job
from rollart.deploy.cluster import object_path
from rollart.messages.samples import sample_messages
from tests.conftest import REPO
from tests.deploy.fake_apiserver import FakeApiServer


def write_config(tmp_path, config) -> str:
    data = {"job": config.job, "pools": ["h800", "h20"], "kafka": {"bootstrap": config.kafka.bootstrap},
            "redis": {"url": config.redis.url},
            "deploy": {"pools": {"h20": {"autoscaling": {"max_replicas": 4}}}}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollart.cli", "deploy", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "KUBECONFIG": "/nonexistent"})


async def test_apply_is_server_side_and_idempotent_and_status_shows_replicas_and_lag(runtime, tmp_path):
    config_path = write_config(tmp_path, runtime.config)
    task = sample_messages()[0]
    for _ in range(5):
        await runtime.producer.send_and_wait("tasks", task, partition=0)
    with FakeApiServer() as api:
        kubeconfig = str(api.kubeconfig(tmp_path / "kubeconfig"))
        first = cli("apply", config_path, "--kubeconfig", kubeconfig)
        assert first.returncode == 0, first.stderr[-3000:]
        from rollart.config import load_config
        from rollart.stages import prepare_config

        docs = render_job(prepare_config(load_config(config_path)))
        assert set(api.objects) == {object_path(d) for d in docs}
        patches = [r for r in api.requests if r["method"] == "PATCH"]
        assert len(patches) == len(docs)
        assert all(r["content_type"] == "application/apply-patch+yaml" and r["query"]["fieldManager"] == "rollart"
                   and r["query"]["force"] == "true" for r in patches)
        assert patches[0]["path"] == "/api/v1/namespaces/rollart"  # the namespace before what lives in it
        uids = {path: obj["metadata"]["uid"] for path, obj in api.objects.items()}

        again = cli("apply", config_path, "--kubeconfig", kubeconfig)
        assert again.returncode == 0, again.stderr[-3000:]
        assert {path: obj["metadata"]["uid"] for path, obj in api.objects.items()} == uids  # updated in place

        job = runtime.config.job.lower()
        api.set_status(f"/apis/apps/v1/namespaces/rollart/deployments/{job}-gen-h20",
                       {"replicas": 3, "readyReplicas": 2, "availableReplicas": 2})
        api.objects[f"/apis/apps/v1/namespaces/rollart/deployments/{job}-gen-h20"]["spec"]["replicas"] = 3  # KEDA's HPA
        api.set_status(f"/apis/keda.sh/v1alpha1/namespaces/rollart/scaledobjects/{job}-env",
                       {"conditions": [{"type": "Ready", "status": "True"}, {"type": "Active", "status": "True"}]})
        status = cli("status", config_path, "--kubeconfig", kubeconfig, "--json")
        assert status.returncode == 0, status.stderr[-3000:]
        rows = {row["stage"]: row for row in json.loads(status.stdout)}
        assert set(rows) == {"feeder", "env", "generation/h800", "generation/h20", "reward", "trainer"}
        h20 = rows["generation/h20"]
        assert (h20["desired"], h20["ready"], h20["min_replicas"], h20["max_replicas"]) == (3, 2, 1, 4)
        assert rows["env"]["lag"] == {"env": 5, "env-actions": 0} and rows["env"]["scaler_active"] is True
        assert rows["reward"]["min_replicas"] == 0 and rows["trainer"]["desired"] == 1
        assert rows["trainer"]["min_replicas"] is None  # one writer: not autoscaled

        table = cli("status", config_path, "--kubeconfig", kubeconfig)
        assert table.returncode == 0 and "2/3" in table.stdout and "env 5" in table.stdout

        dry = cli("apply", config_path, "--kubeconfig", kubeconfig, "--dry-run")
        assert dry.returncode == 0 and all(r["query"].get("dryRun") == "All"
                                           for r in api.requests[-len(docs):])
        api.objects.pop(f"/apis/apps/v1/namespaces/rollart/deployments/{job}-reward")
        missing = cli("status", config_path, "--kubeconfig", kubeconfig, "--json", "--no-lag")
        assert {r["stage"]: r["exists"] for r in json.loads(missing.stdout)}["reward"] is False
