"""`rollart run` end to end on the test stack: every stage a process, the trainer killed with
SIGKILL mid-run (the runner restarts it with --resume), the job's Redis state deleted mid-run, a
resumed run, and the shipped demo learning (alpha = 0 is run by tests/job/test_eval_run.py).

Uses the session's tiny random model (no warm start): this test is about the loop and its
guarantees, not about how much the policy learns.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import psutil
import pytest
import yaml

from tests.conftest import REPO
from tests.job.harness import finish, small_job, start, trained_steps, wait


@pytest.mark.timeout(900)
def test_a_colocated_run_survives_its_envgen_member_killed(endpoints, tiny_model, tmp_path):
    """env.colocate_pool: one process holds the env member, the generation member and its engine. SIGKILL
    it mid-run: the runner restarts it, its engine does not outlive it, the groups it was running are
    rerun and the run trains every step, no trajectory twice."""
    steps = 5
    job = small_job(endpoints, tiny_model, generation={"transport": "direct"}, env={"colocate_pool": "default"})
    proc, out = start(job, tmp_path, steps)
    try:
        wait(lambda: len(trained_steps(out)) >= 2, 300, "2 training steps", proc)
        pids = json.loads((out / "pids.json").read_text())
        assert set(pids) == {"envgen-default-0", "reward-0", "trainer", "feeder"}, "env and generation in one"
        member = psutil.Process(pids["envgen-default-0"])
        engine = [c for c in member.children(recursive=True) if "EngineCore" in " ".join(c.cmdline() + [c.name()])]
        assert engine, "the co-located member holds the engine"
        member.send_signal(signal.SIGKILL)
        psutil.wait_procs(engine, timeout=30)
        assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in engine), "engine outlived it"
        killed_at = len(trained_steps(out))
        wait(lambda: len(trained_steps(out)) >= killed_at + 1, 300, "a step after the member's restart", proc)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    report = finish(proc, out)
    assert [s["step"] for s in report["steps"]] == list(range(1, steps + 1))
    assert report["restarts"].get("envgen-default-0") == 1 and report["trained_duplicates"] == 0
    assert report["staleness_max"] <= 1


@pytest.mark.timeout(900)  # the run's own --timeout: a loaded 2-core machine takes well over 300 s
def test_demo_config_learns(tmp_path):
    """The shipped demo (warm start, GRPO, alpha 1), shortened: the reward must rise."""
    proc = subprocess.Popen([sys.executable, "-m", "rollart.cli", "run", "configs/demo.yaml", "--steps", "30",
                             "--out", str(tmp_path / "demo"), "--timeout", "900"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "ROLLART_HOME": str(tmp_path / "home")})
    report = finish(proc, tmp_path / "demo")
    rewards = [s["reward_mean"] for s in report["steps"]]
    first, last = sum(rewards[:8]) / 8, sum(rewards[-10:]) / 10
    # On failure, what tells a training collapse (grad norm) from engine weights that are not the
    # trainer's (importance weights far from 1) apart:
    trace = [(row["step"], round(row["reward_mean"], 2), round(row["metrics"].get("grad_norm", 0), 3),
              round(row["metrics"].get("importance_weight_mean", 0), 3)) for row in trained_steps(tmp_path / "demo")]
    assert last > first + 0.03, f"reward did not rise: first steps {first:.3f}, last steps {last:.3f}; " \
                                f"(step, reward, grad norm, importance weight): {trace}"
    assert report["staleness_max"] <= 1 and report["trained_duplicates"] == 0
    threads = max(1, (os.cpu_count() or 2) // 2)
    assert f"torch intra-op threads: {threads}" in (tmp_path / "demo" / "logs" / "trainer.log").read_text(), \
        "the run's CPU plan: the trainer gets half the cores, the engine the rest"


def test_the_cpu_plan_leaves_a_configured_thread_count_alone():
    from rollart.config import build_config
    from rollart.job.run import shared_machine_threads

    assert shared_machine_threads(build_config({"trainer": {"torch_threads": 3}})) == {}
    planned = shared_machine_threads(build_config({}))
    assert planned == {"ROLLART_TRAINER_TORCH_THREADS": str(max(1, (os.cpu_count() or 2) // 2))}


@pytest.mark.timeout(900)
def test_run_survives_a_killed_trainer_rank_and_a_redis_flush_then_resumes(endpoints, tiny_model, tmp_path):
    """One job, two runs. The first (6 steps) trains data-parallel on 2 ranks: rank 1 SIGKILLed after 2
    steps (rank 0's next step fails, the runner restarts the trainer with --resume) and the job's Redis
    keys deleted; no step lost or repeated. The second, `rollart run --resume` on the persistent broker
    (to 9 steps) on one rank: same job, trainer from the 2-rank checkpoint, no step retrained and no
    trajectory trained twice across the two runs. (`rollart chaos` kills rank 0 and every other stage;
    this test checks what the run's own report promises.)"""
    import redis as redis_sync

    steps = 6
    proc, out = start(small_job(endpoints, tiny_model, trainer={"micro_batch": 8, "world_size": 2}), tmp_path, steps)
    try:
        wait(lambda: len(trained_steps(out)) >= 2, 300, "2 training steps", proc)
        trainer = psutil.Process(json.loads((out / "pids.json").read_text())["trainer"])
        rank1 = [c for c in trainer.children() if "rollart.training.distributed" in " ".join(c.cmdline())]
        assert len(rank1) == 1, "rank 0 started rank 1 as its child"
        rank1[0].send_signal(signal.SIGKILL)
        killed_at = len(trained_steps(out))
        wait(lambda: len(trained_steps(out)) >= killed_at + 1, 300, "a step after the trainer restart", proc)
        job = json.loads((out / "run.json").read_text())["job"]
        client = redis_sync.Redis.from_url(endpoints.redis_url)
        assert sum(client.delete(k) for k in client.scan_iter(match=f"rollart:{job}:*")) > 0
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    first = finish(proc, out)
    assert [s["step"] for s in first["steps"]] == list(range(1, steps + 1)), "no step lost or repeated"
    assert first["trained_duplicates"] == 0 and all(s["samples"] == 8 for s in first["steps"])
    assert first["alpha"] == 1 and first["staleness_max"] <= 1
    assert first["restarts"].get("trainer") == 1
    assert first["weights"]["transport"] == "mooncake"  # (its loads were recorded in the Redis we flushed)
    assert first["trajectories"]["completed"] >= steps * 8
    assert (out / "report.png").stat().st_size > 0
    versions = [s["trained_version"] for s in first["steps"]]
    assert versions == sorted(versions), "the trainer never went back to an older version"

    (tmp_path / "job.yaml").write_text(yaml.safe_dump(small_job(endpoints, tiny_model)))  # one rank now
    proc = subprocess.Popen([sys.executable, "-m", "rollart.cli", "run", str(tmp_path / "job.yaml"), "--steps", "9",
                             "--out", str(out), "--resume", "--timeout", "600"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    second = finish(proc, out)
    assert json.loads((out / "run.json").read_text())["job"] == job
    assert [s["step"] for s in second["steps"]] == list(range(1, 10))
    assert second["steps"][:steps] == first["steps"], "the first run's steps are kept as they were"
    assert second["trained_duplicates"] == 0
    assert [s["trained_version"] for s in second["steps"]][steps:] == [6, 7, 8]
    assert second["weights"]["versions_loaded"] >= 1, "the restarted engine pulled the trainer's weights"
