"""`rollart run` end to end on the test stack: every stage a process, the trainer killed with
SIGKILL mid-run (the runner restarts it with --resume) and the job's Redis state deleted mid-run.

Uses the session's tiny random model (no warm start): this test is about the loop and its
guarantees, not about how much the policy learns.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import yaml

from tests.conftest import REPO


def _wait(predicate, timeout: float, what: str, proc: subprocess.Popen):
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"rollart run exited with {proc.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _steps(out):
    try:
        lines = (out / "checkpoints" / "record.jsonl").read_text().splitlines()
    except OSError:
        return []
    return [r for r in map(json.loads, lines) if "event" not in r]


def _small_job(endpoints, tiny_model, **overrides) -> dict:
    config = {
        "job": "runtest", "pools": ["default"],
        "kafka": {"bootstrap": endpoints.kafka_bootstrap}, "redis": {"url": endpoints.redis_url},
        "mooncake": {"master": endpoints.mooncake_master, "metadata_server": endpoints.mooncake_metadata},
        "model": {"path": str(tiny_model)},
        "generation": {"max_concurrency": 32, "max_model_len": 1024},
        "feeder": {"group_size": 4, "groups_per_batch": 2, "alpha": 1},
        "env": {"max_groups": 4, "sampling": {"temperature": 1.0, "max_tokens": 2}},
        "trainer": {"micro_batch": 8},
        "bus": {"fetch_max_wait_ms": 5},
        "tags": {"frozenlake": {"env": "frozenlake", "env_kwargs": {}, "max_turns": 3, "reward": {"type": "env"}}},
    }
    for section, values in overrides.items():
        config[section] = {**config.get(section, {}), **values} if isinstance(values, dict) else values
    return config


def _start(config: dict, tmp_path, steps: int) -> tuple[subprocess.Popen, object]:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "rollart.cli", "run", str(path), "--steps", str(steps),
                             "--out", str(out), "--timeout", "600"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    return proc, out


def _finish(proc: subprocess.Popen, out) -> dict:
    try:
        output, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, output[-3000:]
    return json.loads((out / "report.json").read_text())


def test_run_survives_a_killed_trainer_and_a_redis_flush(endpoints, tiny_model, tmp_path):
    import redis as redis_sync

    steps = 10
    proc, out = _start(_small_job(endpoints, tiny_model), tmp_path, steps)
    try:
        _wait(lambda: len(_steps(out)) >= 3, 300, "3 training steps", proc)
        trainer_pid = json.loads((out / "pids.json").read_text())["trainer"]
        os.kill(trainer_pid, signal.SIGKILL)
        killed_at = len(_steps(out))
        _wait(lambda: len(_steps(out)) >= killed_at + 2, 300, "steps after the trainer restart", proc)
        job = json.loads((out / "run.json").read_text())["job"]
        client = redis_sync.Redis.from_url(endpoints.redis_url)
        deleted = sum(client.delete(k) for k in client.scan_iter(match=f"rollart:{job}:*"))
        assert deleted > 0
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    report = _finish(proc, out)
    assert [s["step"] for s in report["steps"]] == list(range(1, steps + 1)), "no step lost or repeated"
    assert report["trained_duplicates"] == 0
    assert all(s["samples"] == 8 for s in report["steps"])
    assert report["alpha"] == 1 and report["staleness_max"] <= 1
    assert report["restarts"].get("trainer") == 1
    assert report["weights"]["versions_loaded"] >= 1 and report["weights"]["transport"] == "mooncake"
    assert report["trajectories"]["completed"] >= steps * 8
    assert (out / "report.png").stat().st_size > 0
    versions = [s["trained_version"] for s in report["steps"]]
    assert versions == sorted(versions), "the trainer never went back to an older version"


def test_alpha_zero_trains_only_on_the_current_policy(endpoints, tiny_model, tmp_path):
    proc, out = _start(_small_job(endpoints, tiny_model, feeder={"alpha": 0}), tmp_path, 4)
    report = _finish(proc, out)
    assert report["alpha"] == 0
    assert [s["staleness_max"] for s in report["steps"]] == [0, 0, 0, 0]
    assert [s["trained_version"] for s in report["steps"]] == [0, 1, 2, 3], "one version per step, in lock step"


def test_demo_config_learns(tmp_path):
    """The shipped demo (warm start, GRPO, alpha 1), shortened: the reward must rise."""
    proc = subprocess.Popen([sys.executable, "-m", "rollart.cli", "run", "configs/demo.yaml", "--steps", "40",
                             "--out", str(tmp_path / "demo"), "--timeout", "900"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "ROLLART_HOME": str(tmp_path / "home")})
    report = _finish(proc, tmp_path / "demo")
    rewards = [s["reward_mean"] for s in report["steps"]]
    first, last = sum(rewards[:8]) / 8, sum(rewards[-10:]) / 10
    assert last > first + 0.03, f"reward did not rise: first steps {first:.3f}, last steps {last:.3f}"
    assert report["staleness_max"] <= 1 and report["trained_duplicates"] == 0


def test_run_resume_continues_the_recorded_run(endpoints, tiny_model, tmp_path):
    """`rollart run --resume` on a persistent broker: same job, trainer from its checkpoint, no step
    retrained and no trajectory trained twice across the two runs."""
    config = _small_job(endpoints, tiny_model)
    proc, out = _start(config, tmp_path, 3)
    first = _finish(proc, out)
    job = json.loads((out / "run.json").read_text())["job"]
    proc = subprocess.Popen([sys.executable, "-m", "rollart.cli", "run", str(tmp_path / "job.yaml"), "--steps", "6",
                             "--out", str(out), "--resume", "--timeout", "600"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    second = _finish(proc, out)
    assert json.loads((out / "run.json").read_text())["job"] == job
    assert [s["step"] for s in second["steps"]] == [1, 2, 3, 4, 5, 6]
    assert second["steps"][:3] == first["steps"], "the first run's steps are kept as they were"
    assert second["trained_duplicates"] == 0
    assert [s["trained_version"] for s in second["steps"]][3:] == [3, 4, 5]
