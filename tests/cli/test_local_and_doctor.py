"""`rollart local up` → `rollart doctor --json` all ok on Apache Kafka; broker gone → doctor fails and
says what to fix; `local up` again restarts the broker on its log; `--broker tansu` is the fallback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rollart.local.stack import free_port, pid_alive, redis_answers
from rollart.messages import MESSAGE_KINDS

ROLLART = [sys.executable, "-m", "rollart.cli"]


def rollart(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*ROLLART, *args], env=env, capture_output=True, text=True, timeout=timeout)


def service_logs(log_dir: str, lines: int = 15) -> str:
    """The last lines of each service's log, for a failure message (why a service died)."""
    tails = [f"\n--- {log.name}:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
             for log in sorted(Path(log_dir).glob("*.log"))]
    return "".join(tails)


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
    assert state["broker"]["kind"] == "kafka" and state["broker"]["version"].startswith("4."), state
    assert redis_answers(state["redis_url"])

    again = rollart("local", "up", "--json", env=cli_env)
    assert json.loads(again.stdout)["started"] is False, "up is idempotent while the stack runs"
    assert rollart("local", "status", env=cli_env).returncode == 0

    doctor = rollart("doctor", "--json", env=cli_env)
    report = json.loads(doctor.stdout)
    assert doctor.returncode == 0 and report["ok"] is True, doctor.stdout + service_logs(state["log_dir"])
    assert report["broker"] == state["broker"]
    listed = rollart("local", "kafka-tool", "kafka-topics", "--list", env=cli_env)
    assert listed.returncode == 0 and "clitest.trajectories.completed" in listed.stdout.split(), listed.stderr
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

    # The log is on disk: the broker started again on it still holds what doctor wrote before the kill.
    back = json.loads(rollart("local", "up", "--json", env=cli_env).stdout)
    assert back["started"] and back["broker_pid"] != state["broker_pid"]
    scratch = subprocess.run(["kcat", "-b", back["kafka_bootstrap"], "-C", "-t", "clitest._doctor", "-e", "-q",
                              "-f", "%o\n"], capture_output=True, text=True, timeout=60)
    assert len(scratch.stdout.split()) >= len(MESSAGE_KINDS), scratch.stderr

    rollart("local", "down", env=cli_env)
    assert not pid_alive(state["redis_pid"]), "down stops the Redis it started"
    assert not pid_alive(back["broker_pid"]), "down stops the broker"


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


def test_local_up_on_tansu_says_so(cli_env):
    up = rollart("local", "up", "--broker", "tansu", "--json", env=cli_env)
    assert up.returncode == 0, up.stderr
    assert json.loads(up.stdout)["broker"]["kind"] == "tansu"
    status = rollart("local", "status", env=cli_env)
    assert status.returncode == 0 and "Tansu" in status.stdout and "in memory" in status.stdout
    assert rollart("local", "up", "--broker", "nope", env=cli_env).returncode == 2, "a bad --broker is refused"
