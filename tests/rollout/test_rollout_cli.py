"""End to end: `rollart rollout configs/rollout-mixed.yaml` then `rollart replay` shows readable trajectories."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO


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
    assert set(summary["by_tag"]) <= {"frozenlake", "sokoban", "math"} and summary["by_tag"]
    for row in summary["by_tag"].values():
        assert {"completed", "reward_mean", "turns_mean"} <= set(row) and row["turns_mean"] >= 1
    assert summary["tokens_generated"] > 0
    assert all(isinstance(v, int) for v in summary["aborted"].values())
    assert set(summary["aborted"]) <= {"redundant"}, "nothing but the redundant extras is aborted here"
    assert all(code == 0 for code in summary["exit_codes"].values()), "every stage stops cleanly on SIGTERM"

    replay = subprocess.run([sys.executable, "-m", "rollart.cli", "replay", "--config", "configs/rollout-mixed.yaml",
                             "--job", summary["job"], "--limit", "3"],
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
