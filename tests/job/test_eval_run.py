"""`rollart run` with ``eval:`` and alpha = 0: held-out evaluation at several versions, each pinned to
its version, beside training in lock step (one run checks both, to spare the suite a second run).

The job trains frozenlake on the default pool and evaluates a held-out tag (weight 0: never trained)
on its own eval pool every 2 versions and at version 0. Every eval trajectory's generated tokens must
come from the version it is pinned to (the engine stamps each token with the version it holds), and
none may reach the trainer. Then `rollart eval --checkpoint` evaluates the run's last checkpoint
offline on the same tasks.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.job.harness import finish, small_job, start


def eval_job(endpoints, tiny_model) -> dict:
    config = small_job(endpoints, tiny_model, feeder={"alpha": 0})
    config["pools"] = ["default", "eval"]
    config["tags"]["frozenlake-eval"] = {"env": "frozenlake", "weight": 0, "max_turns": 3, "reward": {"type": "env"}}
    config["eval"] = {"tags": ["frozenlake-eval"], "pool": "eval", "every_versions": 2, "tasks_per_tag": 4,
                      "group_size": 2, "sampling": {"temperature": 1.0, "max_tokens": 2}}
    return config


@pytest.mark.timeout(900)
def test_eval_runs_at_pinned_versions_and_never_trains(endpoints, tiny_model, tmp_path):
    proc, out = start(eval_job(endpoints, tiny_model), tmp_path, 4)
    report = finish(proc, out)
    assert report["alpha"] == 0
    assert [s["staleness_max"] for s in report["steps"]] == [0, 0, 0, 0], "alpha 0 trains on the current policy only"
    assert [s["trained_version"] for s in report["steps"]] == [0, 1, 2, 3], "one version per step, in lock step"
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["version"] for e in evals] == [0, 2, 4], "version 0 and every 2nd version, in order"
    assert [e["step"] for e in evals] == [0, 2, 4]
    assert all(e["complete"] for e in evals)
    for e in evals:
        assert e["tags"]["frozenlake-eval"]["tasks"] == 4 and e["tags"]["frozenlake-eval"]["scored"] == 8
        assert e["off_version_tokens"] == 0
        assert {tuple(t["versions"]) for t in e["trajectories"]} == {(e["version"],)}, \
            "every generated token of an eval trajectory comes from its pinned version"
    eval_ids = {t["traj_id"] for e in evals for t in e["trajectories"]}
    trained = {i for row in (out / "checkpoints" / "record.jsonl").read_text().splitlines()
               for i in json.loads(row).get("traj_ids", ())}
    assert trained and not eval_ids & trained, "no eval trajectory was trained on"
    assert [e["version"] for e in report["eval"]] == [0, 2, 4] and "trajectories" not in report["eval"][0]

    offline = subprocess.run([sys.executable, "-m", "rollart.cli", "eval", str(tmp_path / "job.yaml"),
                              "--checkpoint", str(out), "--out", str(tmp_path / "offline.json"), "--json"],
                             cwd=REPO, capture_output=True, text=True, timeout=600)
    assert offline.returncode == 0, offline.stdout[-2000:] + offline.stderr[-3000:]
    row = json.loads((tmp_path / "offline.json").read_text())
    assert row["version"] == 4 and row["step"] == 4 and row["complete"]
    assert row["tags"]["frozenlake-eval"]["scored"] == 8
    def members(trajectories):  # the run's job name carries a run id, the offline one is the config's
        return sorted(t["traj_id"].split("-v4-")[1] for t in trajectories)

    assert members(row["trajectories"]) == members(evals[-1]["trajectories"]), "the same eval tasks as the run's"
