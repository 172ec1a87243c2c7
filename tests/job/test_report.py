"""`rollart report OUT` rebuilds the report of a run from its record alone (an interrupted or killed run)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from rollart.cli import app
from rollart.job.report import STEP_FIELDS
from rollart.training.checkpoint import CheckpointStore


def row(step: int, reward: float) -> dict:
    values = {field: 0 for field in STEP_FIELDS}
    return {**values, "step": step, "trained_version": step - 1, "reward_mean": reward, "success_rate": reward,
            "traj_ids": [f"g{step}-0", f"g{step}-1"], "time": 1000.0 + 10 * step, "wait_s": 1.0, "train_s": 2.0}


def test_the_report_is_rebuilt_from_the_record(tmp_path):
    out = tmp_path / "run"
    store = CheckpointStore(out / "checkpoints")
    for step, reward in [(1, 0.0), (2, 0.5), (3, 1.0)]:
        store.append_record(row(step, reward))
    (out / "run.json").write_text(json.dumps({"job": "demo-x", "config": "demo.yaml", "steps": 10, "alpha": 1,
                                              "started_at": 1000.0}))
    evaluation = {"version": 2, "step": 2, "complete": True, "off_version_tokens": 0, "seconds": 4.0,
                  "tags": {"held": {"tasks": 4, "scored": 4, "failed": 0, "success_rate": 0.5, "reward_mean": 0.5,
                                    "turns_mean": 2.0}}, "trajectories": [{"traj_id": "x"}]}
    (out / "eval.jsonl").write_text(json.dumps(evaluation) + "\n")
    result = CliRunner().invoke(app, ["report", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert [s["step"] for s in report["steps"]] == [1, 2, 3] and report["interrupted"]
    assert (report["job"], report["alpha"], report["trained_trajectories"]) == ("demo-x", 1, 6)
    assert report["elapsed_s"] == 30.0 and (out / "report.png").stat().st_size > 0
    assert "3 steps of job demo-x" in result.output
    assert report["eval"] == [{k: v for k, v in evaluation.items() if k != "trajectories"}], "the eval record's"


def test_a_folder_without_a_run_is_refused(tmp_path):
    result = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 2 and "holds no run" in result.output
