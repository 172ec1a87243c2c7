"""Experiment tracking: TensorBoard event files, an offline W&B run and a local MLflow store hold each
step's figures and the run's config; a resumed trainer continues the same run; a tracker that is
configured but not installed fails at start-up naming the field."""

from __future__ import annotations

import pytest

from rollart.config import ConfigError, build_config
from rollart.tracking import Trackers, step_scalars


def row(step: int) -> dict:
    return {"step": step, "trained_version": step - 1, "reward_mean": 0.25 * step, "success_rate": 0.5,
            "staleness_max": 1, "samples": 8, "tokens": 100, "wait_s": 0.1, "train_s": 0.2,
            "metrics": {"pg_loss": -0.01 * step, "grad_norm": 1.5}, "dropped": {"stale_groups": step},
            "traj_ids": ["x"], "lengths": [3]}


def tracking_config(tmp_path, **only):
    tracking = {"tensorboard": {"dir": str(tmp_path / "tb")},
                "wandb": {"mode": "offline", "dir": str(tmp_path / "wandb"), "project": "rollart-test"},
                "mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "rollart-test"}}
    return build_config({"job": "track-1", "tracking": {k: v for k, v in tracking.items() if not only or k in only}})


def test_step_scalars_are_the_rows_numbers_flat():
    scalars = step_scalars(row(2))
    assert scalars["reward_mean"] == 0.5 and scalars["loss/pg_loss"] == -0.02 and scalars["dropped/stale_groups"] == 2
    assert "traj_ids" not in scalars and "lengths" not in scalars and "step" not in scalars


def test_every_tracker_holds_each_step_and_the_config(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = tracking_config(tmp_path)
    trackers = Trackers.from_config(config)
    for step in (1, 2, 3):
        trackers.log(step, row(step))
    trackers.close()

    events = EventAccumulator(str(tmp_path / "tb" / "track-1"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/reward_mean")] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert "train/loss/pg_loss" in events.Tags()["scalars"]

    # An offline run is one transaction log (protobuf records, read back by `wandb sync`; this wandb has
    # no Python reader of it): the history keys, the last value and the config are in it.
    log = next((tmp_path / "wandb" / "wandb").glob("offline-run-*-track-1/run-track-1.wandb")).read_bytes()
    assert b"reward_mean" in log and b"loss/pg_loss" in log and b"0.75" in log
    assert b"feeder" in log and b"track-1" in log, "the run's config"

    import mlflow

    client = mlflow.MlflowClient(tracking_uri=config.tracking.mlflow.tracking_uri)
    run = client.search_runs([client.get_experiment_by_name("rollart-test").experiment_id])[0]
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "reward_mean")] == \
        [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert run.data.params["job"] == "track-1" and run.data.params["feeder.group_size"] == "4"


def test_a_resumed_trainer_continues_the_same_mlflow_run(tmp_path):
    import mlflow

    config = tracking_config(tmp_path, mlflow=True)
    for steps in ((1, 2), (3,)):  # a trainer, then its resumed successor
        trackers = Trackers.from_config(config)
        for step in steps:
            trackers.log(step, row(step))
        trackers.close()
    client = mlflow.MlflowClient(tracking_uri=config.tracking.mlflow.tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name("rollart-test").experiment_id])
    assert len(runs) == 1 and [m.step for m in client.get_metric_history(runs[0].info.run_id, "reward_mean")] == \
        [1, 2, 3]


def test_a_failing_tracker_is_dropped_and_training_goes_on(tmp_path):
    class Broken:
        def log(self, step, scalars):
            raise ConnectionError("tracking server down")

        def close(self):
            pass

    class Kept(list):
        def log(self, step, scalars):
            self.append(step)

        def close(self):
            pass

    kept = Kept()
    trackers = Trackers([Broken(), kept])
    trackers.log(1, row(1))
    trackers.log(2, row(2))
    assert kept == [1, 2] and len(trackers.trackers) == 1


def test_a_configured_tracker_that_is_not_installed_names_the_field(monkeypatch, tmp_path):
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb" or name.startswith("wandb."):
            raise ImportError("no wandb here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    monkeypatch.delitem(__import__("sys").modules, "wandb", raising=False)
    with pytest.raises(ConfigError, match="tracking.wandb: wandb is not installed"):
        Trackers.from_config(tracking_config(tmp_path, wandb=True))


def test_eval_results_go_to_a_run_of_their_own_in_every_tracker(tmp_path):
    import mlflow
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rollart.evaluation.ledger import tracker_scalars
    from rollart.messages import EvalSummary, EvalTagResult

    config = tracking_config(tmp_path)
    trackers = Trackers.from_config(config, role="eval")
    for step, success in ((0, 0.25), (10, 0.75)):
        summary = EvalSummary(job="track-1", version=step, step=step, tags={"held": EvalTagResult(
            tasks=4, scored=4, success_rate=success, reward_mean=success)})
        trackers.log_scalars(step, tracker_scalars(summary))
    trackers.close()
    events = EventAccumulator(str(tmp_path / "tb" / "track-1-eval"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("eval/held/success_rate")] == [(0, 0.25), (10, 0.75)]
    log = next((tmp_path / "wandb" / "wandb").glob("offline-run-*-track-1-eval/run-track-1-eval.wandb")).read_bytes()
    assert b"eval/held/success_rate" in log and b"track-1" in log, "the eval run, in the job's W&B group"
    client = mlflow.MlflowClient(tracking_uri=config.tracking.mlflow.tracking_uri)
    run = client.search_runs([client.get_experiment_by_name("rollart-test").experiment_id])[0]
    assert run.info.run_name == "track-1-eval"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval.held.success_rate")] == \
        [(0, 0.25), (10, 0.75)]
