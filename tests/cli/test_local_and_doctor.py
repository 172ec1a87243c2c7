"""`rollart local up` → `rollart doctor --json` all ok; broker gone → doctor fails and says what to fix."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from rollart.local.stack import free_port, pid_alive, redis_answers
from rollart.messages import MESSAGE_KINDS

ROLLART = [sys.executable, "-m", "rollart.cli"]


def rollart(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*ROLLART, *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def cli_env(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLART_")}
    env.update(ROLLART_HOME=str(tmp_path / "home"), ROLLART_JOB="clitest")
    yield env
    rollart("local", "down", env=env)


def test_local_up_then_doctor_is_all_ok_and_broker_down_fails(cli_env):
    up = rollart("local", "up", "--embedded-redis", "--json", env=cli_env)
    assert up.returncode == 0, up.stderr
    state = json.loads(up.stdout)
    assert state["started"] and state["redis_pid"], "an embedded Redis was started on request"
    assert redis_answers(state["redis_url"])

    again = rollart("local", "up", "--json", env=cli_env)
    assert json.loads(again.stdout)["started"] is False, "up is idempotent while the stack runs"
    assert rollart("local", "status", env=cli_env).returncode == 0

    doctor = rollart("doctor", "--json", env=cli_env)
    report = json.loads(doctor.stdout)
    assert doctor.returncode == 0 and report["ok"] is True, doctor.stdout
    names = {c["name"] for c in report["checks"]}
    assert {"broker", "topics", "redis", "version_store"} <= names
    assert {f"roundtrip:{k.KIND}" for k in MESSAGE_KINDS} <= names
    for check in report["checks"]:
        assert set(check) == {"name", "ok", "detail", "latency_s"} and check["ok"]
        assert isinstance(check["latency_s"], float)

    os.kill(state["broker_pid"], signal.SIGKILL)
    failed = rollart("doctor", "--json", env=cli_env)
    report = json.loads(failed.stdout)
    assert failed.returncode != 0 and report["ok"] is False
    assert "rollart local up" in json.dumps(report)

    human = rollart("doctor", env=cli_env)
    assert human.returncode != 0 and "FAIL" in human.stdout

    rollart("local", "down", env=cli_env)
    assert not pid_alive(state["redis_pid"]), "down stops the Redis it started"


def test_env_endpoints_take_precedence_and_unreachable_broker_is_explained(cli_env, stack):
    env = {**cli_env, "ROLLART_KAFKA_BOOTSTRAP": f"127.0.0.1:{free_port()}", "ROLLART_REDIS_URL": stack.redis_url}
    result = rollart("doctor", "--json", env=env)
    report = json.loads(result.stdout)
    assert result.returncode != 0
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["endpoints"]["ok"] and "from config" in checks["endpoints"]["detail"]
    assert not checks["broker"]["ok"] and "cannot reach the Kafka broker" in checks["broker"]["detail"]
    assert checks["redis"]["ok"], "Redis from ROLLART_REDIS_URL is still checked"
    assert checks["topics"]["detail"].startswith("skipped")


def test_no_stack_and_no_endpoints(cli_env):
    result = rollart("doctor", "--json", env=cli_env)
    assert result.returncode != 0
    assert "rollart local up" in json.loads(result.stdout)["checks"][0]["detail"]


def test_bad_config_fails_naming_the_field(cli_env, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("bus:\n  max_in_flight: -1\n")
    result = rollart("doctor", "--config", str(path), env=cli_env)
    assert result.returncode == 2 and "bus.max_in_flight" in result.stderr
