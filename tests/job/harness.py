"""Running `rollart run` as a subprocess from tests: a small job, start, wait, finish."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import yaml

from tests.conftest import REPO


def wait(predicate, timeout: float, what: str, proc: subprocess.Popen):
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"rollart run exited with {proc.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def trained_steps(out):
    try:
        lines = (out / "checkpoints" / "record.jsonl").read_text().splitlines()
    except OSError:
        return []
    return [r for r in map(json.loads, lines) if "event" not in r]


def small_job(endpoints, tiny_model, **overrides) -> dict:
    config = {
        "job": "runtest", "pools": ["default"],
        "kafka": {"bootstrap": endpoints.kafka_bootstrap}, "redis": {"url": endpoints.redis_url},
        "mooncake": {"master": endpoints.mooncake_master, "metadata_server": endpoints.mooncake_metadata},
        "model": {"path": str(tiny_model)},
        "generation": {"max_concurrency": 32, "max_model_len": 1024, "executor": "uni"},  # starts sooner
        "feeder": {"group_size": 4, "groups_per_batch": 2, "alpha": 1},
        "env": {"max_groups": 4, "sampling": {"temperature": 1.0, "max_tokens": 2}},
        "trainer": {"micro_batch": 8},
        "bus": {"fetch_max_wait_ms": 5},
        "tags": {"frozenlake": {"env": "frozenlake", "env_kwargs": {}, "max_turns": 3, "reward": {"type": "env"}}},
    }
    for section, values in overrides.items():
        config[section] = {**config.get(section, {}), **values} if isinstance(values, dict) else values
    return config


def start(config: dict, tmp_path, steps: int) -> tuple[subprocess.Popen, object]:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "rollart.cli", "run", str(path), "--steps", str(steps),
                             "--out", str(out), "--timeout", "600"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    return proc, out


def finish(proc: subprocess.Popen, out) -> dict:
    try:
        output, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, output[-3000:]
    return json.loads((out / "report.json").read_text())
