"""End to end: `rollart rollout configs/rollout-mixed.yaml` then `rollart replay` shows readable trajectories."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.timeout(600)  # the rollout's own subprocess timeout
def test_rollout_mixed_then_replay(stack, tiny_model, tmp_path):
    env = {**os.environ, "ROLLART_KAFKA_BOOTSTRAP": stack.kafka_bootstrap, "ROLLART_REDIS_URL": stack.redis_url,
           "ROLLART_MODEL_PATH": str(tiny_model), "ROLLART_MODEL_INIT_TINY": "false"}
    out = tmp_path / "rollout"
    result = subprocess.run([sys.executable, "-m", "rollart.cli", "rollout", "configs/rollout-mixed.yaml",
                             "--trajectories", "12", "--out", str(out), "--timeout", "400"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] >= 12
    # the configured mix holds: every tag has its share by weight of the 12, however fast each one is
    assert set(summary["by_tag"]) == {"frozenlake", "sokoban", "math"}
    assert sum(row["share"] for row in summary["by_tag"].values()) == 12
    for row in summary["by_tag"].values():
        assert {"completed", "reward_mean", "turns_mean"} <= set(row) and row["turns_mean"] >= 1
        assert row["completed"] >= row["share"] > 0
    assert "(met)" in result.stdout and "(short)" not in result.stdout
    assert summary["tokens_generated"] > 0
    assert all(isinstance(v, int) for v in summary["aborted"].values())
    assert set(summary["aborted"]) <= {"redundant"}, "nothing but the redundant extras is aborted here"
    assert all(code == 0 for code in summary["exit_codes"].values()), \
        f"every stage stops cleanly on SIGTERM, a pool still loading its engine too: {summary['exit_codes']}"

    replay = subprocess.run([sys.executable, "-m", "rollart.cli", "replay", "--config", "configs/rollout-mixed.yaml",
                             "--job", summary["job"], "--kind", "ScoredTrajectory", "--limit", "3"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert replay.returncode == 0, replay.stderr
    text = replay.stdout
    assert text.count("reward=") == 3 and "[system]" in text and "[user]" in text and "[assistant]" in text
    first_id = text.split()[1]

    one = subprocess.run([sys.executable, "-m", "rollart.cli", "replay", "--config", "configs/rollout-mixed.yaml",
                          "--job", summary["job"], "--traj", first_id, "--json"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    lines = [json.loads(line) for line in one.stdout.splitlines()]
    assert len(lines) == 1 and lines[0]["message"]["trajectory"]["traj_id"] == first_id
    assert "<|im_start|>assistant" in lines[0]["text"]

    follow_env_scored(env, summary["job"])
    follow_and_refeed(env, summary["job"], reward_scored_id(env, summary["job"]))


def replay_cli(env, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollart.cli", "replay", "--config", "configs/rollout-mixed.yaml",
                           *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=180)


def reward_scored_id(env, job: str) -> str:
    """A math trajectory: its tag's reward is scored by the reward stage (configs/rollout-mixed.yaml)."""
    one = replay_cli(env, "--job", job, "--tag", "math", "--kind", "ScoredTrajectory", "--limit", "1", "--json")
    return json.loads(one.stdout.splitlines()[0])["message"]["trajectory"]["traj_id"]


def follow_env_scored(env, job: str) -> None:
    """A grid-world trajectory, scored by the env member that ran it: its score is its completion."""
    one = replay_cli(env, "--job", job, "--tag", "frozenlake", "--kind", "ScoredTrajectory", "--limit", "1", "--json")
    traj_id = json.loads(one.stdout.splitlines()[0])["message"]["trajectory"]["traj_id"]
    history = [json.loads(line) for line in replay_cli(env, "--job", job, "--traj", traj_id, "--follow",
                                                       "--json").stdout.splitlines()]
    kinds = [h["kind"] for h in history]
    assert kinds[0] == "TaskSpec" and kinds[-1] == "ScoredTrajectory" and "CompletedTrajectory" not in kinds
    assert history[-1]["message"]["scorer"] == "env" and history[-1]["topic"].endswith(".rewards.results")
    assert kinds.count("GenerationResult") == history[-1]["message"]["trajectory"]["turns"] >= 1


def follow_and_refeed(env, job: str, traj_id: str) -> None:
    """Replay follows one trajectory across every topic, and re-feeds it into a new job exactly once."""
    followed = replay_cli(env, "--job", job, "--traj", traj_id, "--follow", "--json")
    assert followed.returncode == 0, followed.stderr[-3000:]
    history = [json.loads(line) for line in followed.stdout.splitlines()]
    kinds = [h["kind"] for h in history]
    topics = [h["topic"].split(".", 1)[1] for h in history]
    assert kinds[0] == "TaskSpec" and topics[0] == "tasks"
    assert kinds[-2:] == ["CompletedTrajectory", "ScoredTrajectory"]
    turns = history[-2]["message"]["turns"]
    requests = [h for h in history if h["kind"] == "GenerationRequest"]
    results = [h for h in history if h["kind"] == "GenerationResult"]
    assert len(requests) == len(results) == turns >= 1, "one request and one result per LLM turn"
    assert all(t.startswith("gen.requests.") for t, k in zip(topics, kinds) if k == "GenerationRequest")
    assert all(t == "env.actions" for t, k in zip(topics, kinds) if k == "GenerationResult")
    assert [r["message"]["turn"] for r in requests] == list(range(turns))
    assert all(h["message"].get("traj_id", traj_id) == traj_id for h in history[1:-1])
    stamps = [h["timestamp_ms"] for h in history]
    assert stamps == sorted(stamps), "in the order it happened"
    text = replay_cli(env, "--job", job, "--traj", traj_id, "--follow")
    assert "request turn=0" in text.stdout and "scored reward=" in text.stdout

    source_before = replay_cli(env, "--job", job, "--topic", "trajectories.completed", "--json").stdout
    new_job = job + "-rescore"
    first = replay_cli(env, "--job", job, "--topic", "trajectories.completed", "--traj", traj_id,
                       "--refeed-to", new_job, "--json")
    assert first.returncode == 0, first.stderr[-3000:]
    assert json.loads(first.stdout) == {"selected": 1, "produced": 1, "already_there": 0, "skipped_undecodable": 0}
    again = replay_cli(env, "--job", job, "--topic", "trajectories.completed", "--traj", traj_id,
                       "--refeed-to", new_job, "--json")
    assert json.loads(again.stdout) == {"selected": 1, "produced": 0, "already_there": 1, "skipped_undecodable": 0}
    copied = [json.loads(line) for line in
              replay_cli(env, "--job", new_job, "--topic", "trajectories.completed", "--json").stdout.splitlines()]
    assert [c["message"]["traj_id"] for c in copied] == [traj_id], "exactly once in the new job's topic"
    original = next(json.loads(line) for line in source_before.splitlines()
                    if json.loads(line)["message"].get("traj_id") == traj_id)  # (GroupEnded: a group id)
    assert copied[0]["message"] == original["message"]
    source_after = replay_cli(env, "--job", job, "--topic", "trajectories.completed", "--json").stdout
    assert sorted(source_after.splitlines()) == sorted(source_before.splitlines()), "the source topic is untouched"
    # a reward range of scored trajectories into the new job's trainer input
    scored = replay_cli(env, "--job", job, "--topic", "rewards.results", "--min-reward", "-100", "--refeed-to",
                        new_job, "--json")
    result = json.loads(scored.stdout)
    assert result["selected"] >= 12 and result["produced"] == result["selected"]
    wrong = replay_cli(env, "--job", job, "--topic", "rewards.results", "--refeed-to", new_job,
                       "--refeed-topic", "tasks")
    assert wrong.returncode == 2 and "accepts" in wrong.stderr


@pytest.mark.timeout(600)  # the rollout's own subprocess timeout
def test_rollout_on_a_secured_kafka_with_a_user_and_acls_per_stage(tiny_model, tmp_path):
    """`rollart rollout --secure`: the run's own Apache Kafka speaks only SASL_SSL (SCRAM-SHA-512, a
    throwaway CA) and enforces ACLs; every stage logs in as its own user holding only the ACLs
    rollart.topics.access derives from the catalog, and the loop still completes its trajectories."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLART_KAFKA")}
    env.update(ROLLART_MODEL_PATH=str(tiny_model), ROLLART_MODEL_INIT_TINY="false",
               ROLLART_HOME=str(tmp_path / "home"))
    out = tmp_path / "rollout"
    result = subprocess.run([sys.executable, "-m", "rollart.cli", "rollout", "configs/rollout-mixed.yaml", "--secure",
                             "--trajectories", "2", "--out", str(out), "--timeout", "400"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] >= 2 and all(code == 0 for code in summary["exit_codes"].values()), summary
    job = summary["job"]
    assert summary["stage_users"] == sorted(f"{job}-{s}" for s in ("feeder", "env", "gen-h800", "gen-h20",
                                                                    "reward", "trainer"))
    properties = (out / "kafka" / "server.properties").read_text()
    assert "listeners=SASL_SSL://" in properties and "allow.everyone.if.no.acl.found=false" in properties
    logs = "".join(p.read_text(errors="replace") for p in (out / "logs").glob("*.log"))
    assert "not authorized" not in logs.lower(), "a stage needed more than its ACLs allow"
