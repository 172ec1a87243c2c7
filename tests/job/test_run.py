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


from tests.conftest import REPO
from tests.job.harness import finish, small_job, start, trained_steps, wait


def test_run_survives_a_killed_trainer_and_a_redis_flush(endpoints, tiny_model, tmp_path):
    import redis as redis_sync

    steps = 10
    proc, out = start(small_job(endpoints, tiny_model), tmp_path, steps)
    try:
        wait(lambda: len(trained_steps(out)) >= 3, 300, "3 training steps", proc)
        trainer_pid = json.loads((out / "pids.json").read_text())["trainer"]
        os.kill(trainer_pid, signal.SIGKILL)
        killed_at = len(trained_steps(out))
        wait(lambda: len(trained_steps(out)) >= killed_at + 2, 300, "steps after the trainer restart", proc)
        job = json.loads((out / "run.json").read_text())["job"]
        client = redis_sync.Redis.from_url(endpoints.redis_url)
        deleted = sum(client.delete(k) for k in client.scan_iter(match=f"rollart:{job}:*"))
        assert deleted > 0
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    report = finish(proc, out)
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
    proc, out = start(small_job(endpoints, tiny_model, feeder={"alpha": 0}), tmp_path, 4)
    report = finish(proc, out)
    assert report["alpha"] == 0
    assert [s["staleness_max"] for s in report["steps"]] == [0, 0, 0, 0]
    assert [s["trained_version"] for s in report["steps"]] == [0, 1, 2, 3], "one version per step, in lock step"


def test_demo_config_learns(tmp_path):
    """The shipped demo (warm start, GRPO, alpha 1), shortened: the reward must rise."""
    proc = subprocess.Popen([sys.executable, "-m", "rollart.cli", "run", "configs/demo.yaml", "--steps", "40",
                             "--out", str(tmp_path / "demo"), "--timeout", "900"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "ROLLART_HOME": str(tmp_path / "home")})
    report = finish(proc, tmp_path / "demo")
    rewards = [s["reward_mean"] for s in report["steps"]]
    first, last = sum(rewards[:8]) / 8, sum(rewards[-10:]) / 10
    assert last > first + 0.03, f"reward did not rise: first steps {first:.3f}, last steps {last:.3f}"
    assert report["staleness_max"] <= 1 and report["trained_duplicates"] == 0


def test_run_resume_continues_the_recorded_run(endpoints, tiny_model, tmp_path):
    """`rollart run --resume` on a persistent broker: same job, trainer from its checkpoint, no step
    retrained and no trajectory trained twice across the two runs."""
    config = small_job(endpoints, tiny_model)
    proc, out = start(config, tmp_path, 3)
    first = finish(proc, out)
    job = json.loads((out / "run.json").read_text())["job"]
    proc = subprocess.Popen([sys.executable, "-m", "rollart.cli", "run", str(tmp_path / "job.yaml"), "--steps", "6",
                             "--out", str(out), "--resume", "--timeout", "600"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    second = finish(proc, out)
    assert json.loads((out / "run.json").read_text())["job"] == job
    assert [s["step"] for s in second["steps"]] == [1, 2, 3, 4, 5, 6]
    assert second["steps"][:3] == first["steps"], "the first run's steps are kept as they were"
    assert second["trained_duplicates"] == 0
    assert [s["trained_version"] for s in second["steps"]][3:] == [3, 4, 5]
